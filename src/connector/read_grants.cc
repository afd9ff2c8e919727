// Prefill, read mode: the readers of a held hand-off (read_start, one reader per decode rank),
// their engine grants and read_ok, the end of each reader's read; and decode's side of read_ok.
#include <algorithm>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

namespace connector_internal {
namespace {

// A decode engine's place among the readers of a hand-off: the tensor-parallel size and rank
// of its layout (the group split over the most ranks; replicated groups may carry them too).
std::pair<int, int> ReaderPlace(const Layout& layout) {
  std::pair<int, int> place{1, 0};
  for (const CacheGroup& g : layout.groups) {
    if (g.heads.tp_size > place.first) place = {g.heads.tp_size, g.heads.tp_rank};
  }
  return place;
}

}  // namespace
}  // namespace connector_internal

// read_start: a decode engine is about to READ. The held blocks are bound to it as one of
// their readers (Request::Reader: one per decode rank), so that its death counts at once
// rather than at the end of the lease, and no other peer can release or fail its read; they
// are granted to it in the engine (the only way anyone reads them), and read_ok hands it its
// grant. An id not held here gets "fail" and no grant.
void Connector::Impl::OnReadStart(const InboxEvent& n, PeerMessage& m) {
  const std::string& tid = m.transfer_id;
  Request* r = FindByTransfer(tid);
  if (r == nullptr) {
    if (auto retired = table_.retired_transfers.find(tid);
        retired != table_.retired_transfers.end()) {
      RefuseReadLocked(n.peer, tid, absl::StrCat("it was released: ", retired->second));
      return;
    }
    // Not held (yet): granted if the hold comes within handshake_timeout, else refused.
    auto [it, end] = table_.early_reads.equal_range(tid);
    int asked = 0;
    for (; it != end; ++it, ++asked) {
      if (it->second.peer == n.peer) return;  // asked already
    }
    if (asked >= connector_internal::kMaxReaders) {
      RefuseReadLocked(n.peer, tid,
                       absl::StrCat("more than ", connector_internal::kMaxReaders,
                                    " readers asked for it before it was held"));
      return;
    }
    table_.early_reads.emplace(tid, EarlyRead{n.peer, n.peer_name, ReaderPlaceLocked(n.peer),
                                              absl::Now() + options_.handshake_timeout});
    if (asked > 0) return;  // its id is in the order already
    table_.early_read_order.push_back(tid);
    if (table_.early_read_order.size() > connector_internal::kMaxEarlyReleases) {
      const std::string oldest = std::move(table_.early_read_order.front());
      table_.early_read_order.pop_front();
      auto [e, e_end] = table_.early_reads.equal_range(oldest);
      std::vector<PeerId> refused;
      for (auto x = e; x != e_end; ++x) refused.push_back(x->second.peer);
      table_.early_reads.erase(e, e_end);
      for (PeerId peer : refused) {
        RefuseReadLocked(peer, oldest, "too many read_starts for transfers not held here");
      }
    }
    return;
  }
  if (r->mode != KvMode::kRead || r->state != State::kHeld) {
    ClosePeerLocked(
        n.peer, n.peer_name,
        absl::FailedPreconditionError(absl::StrCat("connector message 'read_start' for transfer ",
                                                   tid, ", which is not a read-mode hand-off")));
    return;
  }
  Request::Reader* reader =
      ClaimReaderLocked(*r, n.peer, n.peer_name, "read_start", ReaderPlaceLocked(n.peer));
  if (reader == nullptr) return;
  if (reader->done) {
    RefuseReadLocked(n.peer, tid, "this reader released it already");
    return;
  }
  GrantReadLocked(*r, n.peer);
}

std::pair<int, int> Connector::Impl::ReaderPlaceLocked(PeerId peer) const {
  auto pit = sessions_.peers.find(peer);
  if (pit == sessions_.peers.end()) return {1, 0};
  return connector_internal::ReaderPlace(pit->second.layout);
}

Connector::Impl::Request::Reader* Connector::Impl::ClaimReaderLocked(Request& r, PeerId peer,
                                                                     const std::string& name,
                                                                     const char* message,
                                                                     std::pair<int, int> place) {
  if (Request::Reader* known = r.FindReader(peer); known != nullptr) return known;
  const int size = place.first, rank = place.second;
  const int expected = r.readers_expected != 0 ? r.readers_expected : size;
  absl::Status refused;
  if (size > connector_internal::kMaxReaders || rank >= size) {
    refused = absl::InvalidArgumentError(
        absl::StrCat("its layout makes it decode rank ", rank, " of ", size, " (at most ",
                     connector_internal::kMaxReaders, " may read one hand-off)"));
  } else if (size != expected) {
    refused = absl::FailedPreconditionError(absl::StrCat(
        "its layout says ", size, " decode ranks read it, its first reader's ", expected));
  } else if (static_cast<int>(r.readers.size()) >= expected ||
             std::any_of(r.readers.begin(), r.readers.end(),
                         [&](const Request::Reader& x) { return x.rank == rank; })) {
    refused = absl::PermissionDeniedError("which is bound to another peer");
  }
  if (!refused.ok()) {
    ClosePeerLocked(
        peer, name,
        absl::Status(refused.code(), absl::StrCat("connector message '", message, "' for transfer ",
                                                  r.params.transfer_id, ", ", refused.message())));
    return nullptr;
  }
  r.readers_expected = expected;
  r.readers.push_back(Request::Reader{peer, rank, 0, false});
  return &r.readers.back();
}

void Connector::Impl::ReaderDoneLocked(Request& r, PeerId peer, ReadEnd how,
                                       const std::string& reason) {
  Request::Reader* reader = r.FindReader(peer);
  if (reader == nullptr || reader->done) return;  // a reader's first word on its read counts
  reader->done = true;
  if (how == ReadEnd::kRead) r.read = true;
  if (how == ReadEnd::kUnread) r.unread = true;
  if (how == ReadEnd::kFailed && r.reader_failure.empty()) r.reader_failure = reason;
  StepLocked(r, Event::kRelease);
  // The blocks stay while a reader may read them and, unless the decode will not read them,
  // until every one of its ranks has been heard from.
  for (const Request::Reader& x : r.readers) {
    if (!x.done) return;
  }
  if (!r.unread && static_cast<int>(r.readers.size()) < r.readers_expected) return;
  if (!r.reader_failure.empty()) {
    FailLocked(r, r.reader_failure);
  } else if (r.read) {
    CompleteLocked(r);
  } else {
    ReleaseUnreadLocked(r, peer, reason);
  }
}

void Connector::Impl::GrantReadLocked(Request& r, PeerId peer) {
  Request::Reader* reader = r.FindReader(peer);
  if (reader == nullptr) return;  // ClaimReaderLocked binds it first
  StepLocked(r, Event::kReadStart);
  if (reader->grant != 0) {
    (void)SendMessage(
        peer,
        json{{"t", "read_ok"}, {"transfer_id", r.params.transfer_id}, {"grant", reader->grant}});
    return;
  }
  if (reader->granting) return;  // read_ok follows the grant being made
  const absl::Status scrubbed = ScrubUnfilledLocked(r);
  absl::StatusOr<std::vector<GrantRange>> ranges =
      scrubbed.ok() ? GrantRangesLocked(r) : absl::StatusOr<std::vector<GrantRange>>(scrubbed);
  if (!ranges.ok()) {
    OnGrantedLocked(r.id, peer, ranges.status());
    return;
  }
  // The engine call is the action phase's, made once mu_ is released (FlushOutbox); its
  // answer comes back to OnGrantedLocked, which sends read_ok.
  reader->granting = true;
  if (outbox_.queue.empty() && !outbox_.draining) signal_->Notify();  // as SendMessage
  OutMessage m;
  m.peer = peer;
  m.grant = OutGrant{r.id, std::move(*ranges)};
  outbox_.queue.push_back(std::move(m));
}

void Connector::Impl::OnGrantedLocked(const std::string& request, PeerId peer,
                                      absl::StatusOr<GrantId> grant) {
  auto it = table_.requests.find(request);
  Request* r = it == table_.requests.end() ? nullptr : &it->second;
  Request::Reader* reader = r == nullptr ? nullptr : r->FindReader(peer);
  if (reader != nullptr) reader->granting = false;
  if (r == nullptr || reader == nullptr) {
    // The hold ended meanwhile (its blocks are gone): the grant goes at once.
    if (grant.ok()) {
      OutMessage m;
      m.peer = peer;
      m.revoke = OutRevoke{0, *grant, 0};
      outbox_.queue.push_back(std::move(m));
    }
    return;
  }
  if (r->state == State::kReleasing) {
    // Its release came while the grant was being made: the watch AwaitServedLocked kept for
    // this reader revokes it once its bytes were served (or ends now if none was made).
    for (Request::Serving& s : r->serving) {
      if (s.peer != peer || s.grant != 0) continue;
      if (!grant.ok()) {
        OnServedLocked(s.ticket);
        return;
      }
      s.grant = *grant;
      OutMessage m;
      m.peer = peer;
      const uint64_t bytes = options_.read_grants && !r->revoke_forced
                                 ? reader->read_bytes.value_or(0)
                                 : 0;  // past the deadline: revoked at once
      m.revoke = OutRevoke{s.ticket, *grant, bytes};
      outbox_.queue.push_back(std::move(m));
      return;
    }
  }
  if (!grant.ok()) {
    const std::string reason = absl::StrCat("granting the blocks: ", grant.status().message());
    (void)SendMessage(
        peer, json{{"t", "fail"}, {"transfer_id", r->params.transfer_id}, {"reason", reason}});
    if (r->state != State::kHeld) return;
    StepLocked(*r, Event::kGrantFailed);
    FailLocked(*r, reason);
    return;
  }
  reader->grant = *grant;
  if (r->state != State::kHeld || reader->done) return;  // revoked with the others
  (void)SendMessage(
      peer, json{{"t", "read_ok"}, {"transfer_id", r->params.transfer_id}, {"grant", *grant}});
}

void Connector::Impl::RefuseReadLocked(PeerId peer, const std::string& tid,
                                       const std::string& why) {
  accounting_.ReadRefused();
  KVW_LOG(kWarning, kLog) << "read_start refused" << Kv("peer", peer)
                          << Kv("transfer", tid.substr(0, 64)) << Kv("why", why);
  if (!PeerAlive(peer)) return;
  (void)SendMessage(
      peer, json{{"t", "fail"},
                 {"transfer_id", tid},
                 {"reason", absl::StrCat("prefill engine ", engine_->name(),
                                         " holds no blocks under transfer id ", tid, ": ", why)}});
}

absl::StatusOr<std::vector<GrantRange>> Connector::Impl::GrantRangesLocked(const Request& r) {
  // The ranges come out in (region, offset) order wherever the layout allows, so that the
  // engine's grant table need not sort them (for a dsv4-pro request, ~3,000 ranges per reader
  // were most of Engine::Grant): each layer's pages in address order (its block ids sorted,
  // the components of a block inside it when they are block-major), then the layers' runs
  // ordered by where they begin. Ranges that still come out of order (layers whose pages
  // interleave) are sorted by the table, so the order is a speed-up, never a condition.
  std::vector<GrantRange> ranges;
  struct Run {
    size_t begin;
    size_t end;
  };
  std::vector<Run> runs;
  std::vector<uint64_t> blocks;
  connector_internal::RegionFinder regions(local_regions_);
  for (const CacheGroup& g : layout_.groups) {
    auto found = r.blocks.find(g.name);
    if (found == r.blocks.end()) continue;
    blocks.clear();
    for (int64_t block : found->second) {
      if (block < 0) continue;  // no block here (e.g. outside a sliding window)
      if (static_cast<uint64_t>(block) >= g.num_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("cache group '", g.name, "': block ", block, " of ", g.num_blocks));
      }
      blocks.push_back(static_cast<uint64_t>(block));
    }
    if (blocks.empty()) continue;
    std::sort(blocks.begin(), blocks.end());
    const bool block_major = g.block_major || g.components == 1;
    for (size_t l = 0; l < g.layers.size(); ++l) {
      const size_t begin = ranges.size();
      for (size_t i = 0; i < blocks.size() * static_cast<size_t>(g.components); ++i) {
        const uint64_t block = block_major ? blocks[i / g.components] : blocks[i % blocks.size()];
        const int c = static_cast<int>(block_major ? i % g.components : i / blocks.size());
        const uint64_t addr = g.BlockAddress(l, block, c);
        const RegionSpan* region = regions.Find(addr, g.page_bytes);
        if (region == nullptr) {
          return connector_internal::FindRegion(local_regions_, addr, g.page_bytes, "local")
              .status();
        }
        ranges.push_back({region->id, addr - region->base, g.page_bytes});
      }
      runs.push_back({begin, ranges.size()});
    }
  }
  if (ranges.empty()) return absl::FailedPreconditionError("the request holds no blocks");
  const auto key = [&](const Run& run) {
    return std::pair(ranges[run.begin].region, ranges[run.begin].offset);
  };
  const auto before = [&](const Run& a, const Run& b) { return key(a) < key(b); };
  if (std::is_sorted(runs.begin(), runs.end(), before)) return ranges;
  std::sort(runs.begin(), runs.end(), before);
  std::vector<GrantRange> ordered;
  ordered.reserve(ranges.size());
  for (const Run& run : runs) {
    ordered.insert(ordered.end(), ranges.begin() + run.begin, ranges.begin() + run.end);
  }
  return ordered;
}

void Connector::Impl::RevokeGrantLocked(Request& r) {
  if (r.decode) return;
  // A prefill read-mode request ends through kReleasing (AwaitServedLocked), which takes its
  // grants: any left here belong to a request that ended otherwise; revoked outside mu_.
  bool queued = false;
  for (Request::Reader& reader : r.readers) {
    const GrantId grant = std::exchange(reader.grant, 0);
    if (grant == 0) continue;
    OutMessage m;
    m.peer = reader.peer;
    m.revoke = OutRevoke{0, grant, 0};
    outbox_.queue.push_back(std::move(m));
    queued = true;
  }
  if (queued && !outbox_.draining) signal_->Notify();
}

// read_ok: a prefill source granted a read-mode load's blocks to this engine.
// The prefill ranks of one hand-off (tp_sources) share its transfer id: a read_ok is matched
// on the transfer id and the peer, and refused only when no source of that id is this peer.
void Connector::Impl::OnReadOk(const InboxEvent& n, PeerMessage& m) {
  for (auto& [id, r] : table_.requests) {
    if (!r.decode || r.mode != KvMode::kRead) continue;
    bool this_transfer = false;
    for (Request::ReadSource& s : r.read_sources) {
      if (s.transfer_id != m.transfer_id) continue;
      this_transfer = true;
      if (s.peer != n.peer) continue;
      if (r.state != State::kLoading || !r.fail_reason.empty() || s.grant) return;
      s.grant = m.grant;
      StepLocked(r, Event::kReadOk);  // all_granted: the row's action is submit_reads
      if (std::all_of(r.read_sources.begin(), r.read_sources.end(),
                      [](const Request::ReadSource& x) { return x.grant.has_value(); })) {
        SubmitReadsLocked(r);
      }
      return;
    }
    if (this_transfer) {
      RefuseBoundElsewhere(n, m);
      return;
    }
  }
  // Else: a load that ended here already.
}

}  // namespace kvwire
