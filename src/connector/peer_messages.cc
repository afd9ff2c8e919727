// Connector peers: the handshake (hello / hello_ack / hello_err: layouts, regions, modes),
// the messages of running requests, peer deaths, and the progress thread that drives them.
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

// Keeps an early release of `tid` by its peer (each reader's first one; at most kMaxReaders
// of one transfer id), dropping the oldest transfer id's beyond kMaxEarlyReleases. A template
// so that it names no private type of Connector::Impl.
template <typename Release>
void RememberEarlyRelease(std::multimap<std::string, Release>& releases,
                          std::deque<std::string>& order, const std::string& tid, Release release) {
  auto [it, end] = releases.equal_range(tid);
  const bool known = it != end;
  size_t readers = 0;
  for (; it != end; ++it, ++readers) {
    if (it->second.peer == release.peer) return;
  }
  if (readers >= static_cast<size_t>(kMaxReaders)) return;
  releases.emplace(tid, std::move(release));
  if (known) return;  // its id is in `order` already
  order.push_back(tid);
  if (order.size() > connector_internal::kMaxEarlyReleases) {
    releases.erase(order.front());
    order.pop_front();
  }
}

// A decode engine's place among the readers of a hand-off: the tensor-parallel size and rank
// of its layout (the group split over the most ranks; replicated groups may carry them too).
std::pair<int, int> ReaderPlace(const Layout& layout) {
  std::pair<int, int> place{1, 0};
  for (const CacheGroup& g : layout.groups) {
    if (g.heads.tp_size > place.first) place = {g.heads.tp_size, g.heads.tp_rank};
  }
  return place;
}

// hello, hello_ack: the sender's engine, mode, layout and regions.
void ParseHello(JsonFields& f, PeerMessage& m) {
  m.engine_id = f.String("engine_id", 256);
  const std::string mode = f.OptString("mode", "auto", 16);
  if (absl::StatusOr<KvMode> k = ParseKvMode(mode); k.ok()) {
    m.mode = *k;
  } else {
    f.Fail("mode", absl::StrCat("must be read, write or auto, got \"", mode, "\""));
  }
  if (const nlohmann::json* layout = f.Object("layout", /*required=*/true); layout != nullptr) {
    absl::StatusOr<Layout> l = LayoutFromJsonValue(*layout);
    if (l.ok()) {
      m.layout = std::move(*l);
    } else {
      f.Fail("layout", absl::StrCat("is not usable: ", l.status().message()));
    }
  }
  const nlohmann::json* regions = f.Array("regions", /*required=*/true, kMaxRegions);
  for (size_t i = 0; regions != nullptr && i < regions->size() && f.ok(); ++i) {
    const nlohmann::json& r = (*regions)[i];
    const std::string name = absl::StrCat("regions[", i, "]");
    if (!r.is_array() || r.size() != 3) {
      f.Fail(name, "must be [base, length, region id]");
      break;
    }
    RegionSpan span;
    span.base = f.UintValue(r[0], name + "[0]");
    span.length = f.UintValue(r[1], name + "[1]");
    span.id = f.UintValue(r[2], name + "[2]");
    if (f.ok() && span.length > std::numeric_limits<uint64_t>::max() - span.base) {
      f.Fail(name, "ends past the end of the address space");
    }
    m.regions.push_back(span);
  }
}

void ParseHelloErr(JsonFields& f, PeerMessage& m) {
  m.reason = f.OptString("error", "?", kMaxReasonBytes);
}

// Every message about one transfer names it.
void ParseTransferId(JsonFields& f, PeerMessage& m) {
  m.transfer_id = f.String("transfer_id", kMaxTransferIdBytes);
  if (f.ok() && m.transfer_id.empty()) f.Fail("transfer_id", "is empty");
}

void ParseRelease(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.ok = f.OptBool("ok", true);
  m.unread = f.OptBool("unread", false);
  m.reason = f.OptString("reason", "?", kMaxReasonBytes);
}

void ParseWriteReq(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.blocks = BlocksFromJson(f, "blocks", /*required=*/true);
  m.num_cached = f.OptUint("num_cached", uint64_t{1} << 40, 0);
}

void ParseLayer(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.layer = static_cast<int>(f.Int("layer", 0, 1 << 30));
}

void ParseDone(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  (void)f.OptUint("bytes", std::numeric_limits<uint64_t>::max(), 0);
}

void ParseReadOk(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.grant = f.Uint("grant", std::numeric_limits<uint64_t>::max());
  if (f.ok() && m.grant == 0) f.Fail("grant", "is 0");
}

void ParseFail(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.unread = f.OptBool("unread", false);
  m.reason = f.OptString("reason", "?", kMaxReasonBytes);
}

// The wire name of each message type and the parser of its fields.
struct MessageFormat {
  const char* name;
  PeerMessage::Type type;
  void (*parse)(JsonFields& f, PeerMessage& m);
};
constexpr MessageFormat kMessageFormats[] = {
    {"hello", PeerMessage::Type::kHello, ParseHello},
    {"hello_ack", PeerMessage::Type::kHelloAck, ParseHello},
    {"hello_err", PeerMessage::Type::kHelloErr, ParseHelloErr},
    {"read_start", PeerMessage::Type::kReadStart, ParseTransferId},
    {"release", PeerMessage::Type::kRelease, ParseRelease},
    {"write_req", PeerMessage::Type::kWriteReq, ParseWriteReq},
    {"layer", PeerMessage::Type::kLayer, ParseLayer},
    {"done", PeerMessage::Type::kDone, ParseDone},
    {"fail", PeerMessage::Type::kFail, ParseFail},
    {"read_ok", PeerMessage::Type::kReadOk, ParseReadOk},
};

}  // namespace

absl::StatusOr<PeerMessage> ParsePeerMessage(const std::string& payload) {
  absl::StatusOr<nlohmann::json> j = ParseJsonObject(payload, "connector message");
  if (!j.ok()) return j.status();
  PeerMessage m;
  {
    JsonFields head(*j, "connector message");
    m.name = head.String("t", 32);
    if (!head.ok()) return head.status();
  }
  const MessageFormat* format =
      std::find_if(std::begin(kMessageFormats), std::end(kMessageFormats),
                   [&](const MessageFormat& t) { return m.name == t.name; });
  if (format == std::end(kMessageFormats)) {
    return absl::InvalidArgumentError(
        absl::StrCat("connector message of unknown type '", m.name, "'"));
  }
  m.type = format->type;
  JsonFields f(*j, absl::StrCat("connector message '", m.name, "'"));
  format->parse(f, m);
  if (!f.ok()) return f.status();
  return m;
}

}  // namespace connector_internal

nlohmann::json Connector::Impl::HelloBody() const {
  json regions = json::array();
  for (const RegionSpan& r : local_regions_) regions.push_back({r.base, r.length, r.id});
  return {{"engine_id", engine_->name()},
          {"mode", KvModeName(options_.mode)},
          {"layout", connector_internal::LayoutToJsonValue(layout_)},
          {"regions", regions}};
}

// Decode: connects to the prefill engine at `address` and runs the connector handshake.
absl::StatusOr<PeerId> Connector::Impl::EnsurePeer(const std::string& address) {
  {
    MutexLock lock(&mu_);
    auto it = sessions_.by_address.find(address);
    if (it != sessions_.by_address.end()) {
      auto p = sessions_.peers.find(it->second);
      if (p != sessions_.peers.end() && p->second.ready) return p->second.id;
      if (p != sessions_.peers.end() && !p->second.error.empty()) {
        return absl::FailedPreconditionError(p->second.error);
      }
    }
  }
  absl::StatusOr<PeerId> peer = engine_->Connect(address);
  if (!peer.ok()) return peer.status();
  const absl::Time deadline = absl::Now() + options_.handshake_timeout;
  const PeerId id = *peer;
  std::vector<RegionId> regions;
  {
    MutexLock lock(&mu_);
    if (!PeerAlive(id)) {
      return absl::UnavailableError(
          absl::StrCat("connector handshake with ", address, ": the peer closed"));
    }
    {
      Peer& p = sessions_.peers[id];
      p.id = id;
      p.address = address;
    }
    sessions_.by_address[address] = id;
    json hello = HelloBody();
    hello["t"] = "hello";
    if (absl::Status s = SendMessage(id, hello); !s.ok()) return s;
    // Looked up again after every wait: a peer that dies is forgotten (OnPeerDeath).
    std::string error;
    while (true) {
      auto p = sessions_.peers.find(id);
      if (p == sessions_.peers.end()) {
        error = absl::StrCat("connector handshake with ", address, ": the peer closed");
        break;
      }
      if (p->second.ready) {
        for (const RegionSpan& r : p->second.regions) regions.push_back(r.id);
        break;
      }
      if (!p->second.error.empty()) {
        error = p->second.error;
        break;
      }
      if (!cv_.WaitUntil(&mu_, deadline) && absl::Now() >= deadline) {
        error = absl::StrCat("connector handshake with ", address,
                             " timed out (is it a kvwire connector?)");
        p = sessions_.peers.find(id);
        if (p != sessions_.peers.end()) p->second.error = error;
        break;
      }
    }
    if (!error.empty()) {
      if (auto a = sessions_.by_address.find(address);
          a != sessions_.by_address.end() && a->second == id) {
        sessions_.by_address.erase(a);
      }
      return absl::FailedPreconditionError(error);
    }
  }
  // Prefill's KV regions become usable here asynchronously.
  for (RegionId r : regions) {
    absl::Status s =
        engine_->WaitForRemoteRegion(id, r, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!s.ok()) return s;
  }
  return id;
}

// Each message type has one handler, which gets the parsed, typed message; a message that
// does not parse (unknown type included) closes its sender alone.
void Connector::Impl::OnMessage(const InboxEvent& n) {
  using Type = PeerMessage::Type;
  struct Route {
    Type type;
    bool after_handshake;  // refused from a peer whose connector handshake is not done
    void (Impl::*handle)(const InboxEvent& from, PeerMessage& m);
  };
  static constexpr Route kRoutes[] = {
      {Type::kHello, false, &Impl::OnHelloMessage},
      {Type::kHelloAck, false, &Impl::OnHelloAnswer},
      {Type::kHelloErr, false, &Impl::OnHelloAnswer},
      {Type::kReadStart, true, &Impl::OnReadStart},
      {Type::kRelease, true, &Impl::OnRelease},
      {Type::kWriteReq, true, &Impl::OnWriteRequest},
      {Type::kLayer, true, &Impl::OnLayer},
      {Type::kDone, true, &Impl::OnDone},
      {Type::kFail, true, &Impl::OnFail},
      {Type::kReadOk, true, &Impl::OnReadOk},
  };
  if (!PeerAlive(n.peer)) return;  // closed here earlier in this batch
  absl::StatusOr<PeerMessage> parsed = connector_internal::ParsePeerMessage(n.payload);
  if (!parsed.ok()) {
    ClosePeerLocked(n.peer, n.peer_name, parsed.status());
    return;
  }
  const Route* route = std::find_if(std::begin(kRoutes), std::end(kRoutes),
                                    [&](const Route& r) { return r.type == parsed->type; });
  if (route == std::end(kRoutes)) {  // a type the parser knows and nothing handles
    ClosePeerLocked(n.peer, n.peer_name,
                    absl::InternalError(absl::StrCat("connector message '", parsed->name,
                                                     "' has no handler here")));
    return;
  }
  if (route->after_handshake) {
    auto pit = sessions_.peers.find(n.peer);
    if (pit == sessions_.peers.end() || !pit->second.ready) {
      ClosePeerLocked(
          n.peer, n.peer_name,
          absl::FailedPreconditionError(absl::StrCat("connector message '", parsed->name,
                                                     "' before the connector handshake")));
      return;
    }
  }
  (this->*route->handle)(n, *parsed);
}

// hello: queued until the regions it names arrived (ServePendingHellos answers it).
void Connector::Impl::OnHelloMessage(const InboxEvent& n, PeerMessage& m) {
  const bool pending = std::any_of(sessions_.pending_hellos.begin(), sessions_.pending_hellos.end(),
                                   [&](const PendingHello& h) { return h.peer == n.peer; });
  if (sessions_.peers.contains(n.peer) || pending) {
    ClosePeerLocked(n.peer, n.peer_name,
                    absl::FailedPreconditionError(
                        "connector message 'hello' repeated or unexpected (the connector "
                        "handshake runs once per connection, from the dialing side)"));
    return;
  }
  sessions_.pending_hellos.push_back(
      {n.peer, n.peer_name, std::move(m), absl::Now() + options_.handshake_timeout});
}

// hello_ack, hello_err: only the answer to our own hello, once.
void Connector::Impl::OnHelloAnswer(const InboxEvent& n, PeerMessage& m) {
  auto pit = sessions_.peers.find(n.peer);
  if (pit == sessions_.peers.end() || pit->second.address.empty() || pit->second.ready ||
      !pit->second.error.empty()) {
    ClosePeerLocked(n.peer, n.peer_name,
                    absl::FailedPreconditionError(absl::StrCat(
                        "connector message '", m.name, "' without a hello of ours to answer")));
    return;
  }
  Peer& p = pit->second;
  if (m.type == PeerMessage::Type::kHelloErr) {
    p.error = absl::StrCat("prefill engine refused the connector handshake: ", m.reason);
  } else if (absl::Status s = CheckCompatible(m.layout, layout_); s.ok()) {
    p.engine_id = std::move(m.engine_id);
    p.layout = std::move(m.layout);
    p.regions = std::move(m.regions);
    p.ready = true;
    p.decode_mode = options_.mode;
    p.prefill_mode = m.mode;
  } else {
    p.error = std::string(s.message());
  }
  cv_.SignalAll();
}

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
  if (reader->grant == 0) {
    const absl::Status scrubbed = ScrubUnfilledLocked(r);
    absl::StatusOr<std::vector<GrantRange>> ranges =
        scrubbed.ok() ? GrantRangesLocked(r) : absl::StatusOr<std::vector<GrantRange>>(scrubbed);
    absl::StatusOr<GrantId> grant =
        ranges.ok() ? engine_->Grant(peer, *ranges) : absl::StatusOr<GrantId>(ranges.status());
    if (!grant.ok()) {
      const std::string reason = absl::StrCat("granting the blocks: ", grant.status().message());
      (void)SendMessage(
          peer, json{{"t", "fail"}, {"transfer_id", r.params.transfer_id}, {"reason", reason}});
      FailLocked(r, reason);
      return;
    }
    reader->grant = *grant;
  }
  (void)SendMessage(
      peer,
      json{{"t", "read_ok"}, {"transfer_id", r.params.transfer_id}, {"grant", reader->grant}});
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
  std::vector<GrantRange> out;
  for (const CacheGroup& g : layout_.groups) {
    auto blocks = r.blocks.find(g.name);
    if (blocks == r.blocks.end()) continue;
    for (int64_t block : blocks->second) {
      if (block < 0) continue;  // no block here (e.g. outside a sliding window)
      if (static_cast<uint64_t>(block) >= g.num_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("cache group '", g.name, "': block ", block, " of ", g.num_blocks));
      }
      for (size_t l = 0; l < g.layers.size(); ++l) {
        for (int c = 0; c < g.components; ++c) {
          const uint64_t addr = g.BlockAddress(l, static_cast<uint64_t>(block), c);
          absl::StatusOr<std::pair<RegionId, uint64_t>> where =
              connector_internal::FindRegion(local_regions_, addr, g.page_bytes, "local");
          if (!where.ok()) return where.status();
          out.push_back({where->first, where->second, g.page_bytes});
        }
      }
    }
  }
  if (out.empty()) return absl::FailedPreconditionError("the request holds no blocks");
  return out;
}

void Connector::Impl::RevokeGrantLocked(Request& r) {
  if (r.decode) return;
  std::vector<PeerId> revoked;
  for (Request::Reader& reader : r.readers) {
    const GrantId grant = std::exchange(reader.grant, 0);
    // NotFound: the peer closed, and the engine dropped its grants with it.
    if (grant != 0 && engine_->Revoke(reader.peer, grant).ok()) revoked.push_back(reader.peer);
  }
  // A READ that began under a grant before the revocation may still be copying: the blocks
  // go back to the scheduler only once it ended. A reader's release was preceded by
  // WaitForServedOps already, so this returns at once unless a peer kept reading after its
  // own release; bounded (once for all readers) for peers that keep an op stalled.
  constexpr absl::Duration kRevokeWait = absl::Milliseconds(250);
  const absl::Time deadline = absl::Now() + kRevokeWait;
  for (PeerId peer : revoked) {
    if (absl::Status s =
            engine_->WaitForServedOps(peer, std::max(absl::ZeroDuration(), deadline - absl::Now()));
        !s.ok()) {
      KVW_LOG(kWarning, kLog) << "a READ under a revoked grant is still served"
                              << Kv("request", r.id) << Kv("peer", peer)
                              << Kv("error", s.message());
    }
  }
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

// release: the reader is done with a read-mode hand-off (or failed).
void Connector::Impl::OnRelease(const InboxEvent& n, PeerMessage& m) {
  const std::string& tid = m.transfer_id;
  Request* r = FindByTransfer(tid);
  if (r == nullptr) {
    // Ended here already, or not held yet (see table_.early_releases): kept for a while.
    // The reason is cut short: thousands of these may wait.
    connector_internal::RememberEarlyRelease(
        table_.early_releases, table_.early_release_order, tid,
        EarlyRelease{n.peer, ReaderPlaceLocked(n.peer), m.ok, m.unread, m.reason.substr(0, 256)});
    return;
  }
  if (r->mode != KvMode::kRead) {
    ClosePeerLocked(
        n.peer, n.peer_name,
        absl::FailedPreconditionError(absl::StrCat("connector message 'release' for transfer ", tid,
                                                   ", which is not a read-mode hand-off")));
    return;
  }
  if (ClaimReaderLocked(*r, n.peer, n.peer_name, "release", ReaderPlaceLocked(n.peer)) == nullptr) {
    return;
  }
  if (m.unread) {
    ReaderDoneLocked(*r, n.peer, ReadEnd::kUnread, m.reason);
  } else if (m.ok) {
    ReaderDoneLocked(*r, n.peer, ReadEnd::kRead, "");
  } else {
    ReaderDoneLocked(*r, n.peer, ReadEnd::kFailed, absl::StrCat("reader failed: ", m.reason));
  }
}

// layer, done, fail on the decode side: results of a write-mode load (or prefill stopping),
// accepted only from the prefill the load is bound to.
Connector::Impl::LoadResult Connector::Impl::OnLoadResult(const InboxEvent& n,
                                                          const PeerMessage& m) {
  using Type = PeerMessage::Type;
  Request* d = nullptr;
  std::optional<PeerId> d_peer;
  for (auto& [id, r] : table_.requests) {
    if (!r.decode) continue;
    if (r.params.transfer_id == m.transfer_id) {
      d = &r;
      d_peer = r.peer;
      break;
    }
    for (const auto& [source, source_tid] : r.tp_sources) {
      if (source_tid == m.transfer_id) {
        d = &r;
        d_peer = source;
      }
    }
    if (d != nullptr) break;
  }
  if (d == nullptr) return LoadResult::kNotALoad;
  if (d_peer != n.peer) return LoadResult::kBoundElsewhere;
  Request& r = *d;
  if (r.mode != KvMode::kWrite) {
    // Read mode: a "fail" before the READs started (the prefill refused the read_start: it
    // holds no such transfer, or could not grant it) ends the load; once they started, the
    // READs themselves fail.
    if (m.type == Type::kFail && r.state == State::kLoading && r.transfers.empty()) {
      FailLocked(r, r.fail_reason.empty() ? absl::StrCat("prefill: ", m.reason) : r.fail_reason);
    }
    return LoadResult::kHandled;
  }
  if (r.state != State::kLoading && r.state != State::kDraining) return LoadResult::kHandled;
  if (m.type == Type::kLayer) {
    r.layers_pending.erase(m.layer);
    cv_.SignalAll();  // WaitForLayerLoad
  } else if (m.type == Type::kDone && r.state == State::kLoading && r.fail_reason.empty()) {
    CompleteLocked(r);
  } else {
    r.abort_sent = true;  // prefill writes nothing more
    FailLocked(r, r.fail_reason.empty() ? absl::StrCat("prefill: ", m.reason) : r.fail_reason);
  }
  return LoadResult::kHandled;
}

void Connector::Impl::RefuseBoundElsewhere(const InboxEvent& n, const PeerMessage& m) {
  ClosePeerLocked(
      n.peer, n.peer_name,
      absl::PermissionDeniedError(absl::StrCat("connector message '", m.name, "' for transfer ",
                                               m.transfer_id, ", which is bound to another peer")));
}

void Connector::Impl::OnLayer(const InboxEvent& n, PeerMessage& m) {
  // Else: a transfer that ended here already (or never was): nothing to do.
  if (OnLoadResult(n, m) == LoadResult::kBoundElsewhere) RefuseBoundElsewhere(n, m);
}

void Connector::Impl::OnDone(const InboxEvent& n, PeerMessage& m) {
  if (OnLoadResult(n, m) == LoadResult::kBoundElsewhere) RefuseBoundElsewhere(n, m);
}

// fail: on decode, prefill stopped a load; on prefill, decode aborted a write-mode transfer
// (stop sending; answer when nothing is in flight).
void Connector::Impl::OnFail(const InboxEvent& n, PeerMessage& m) {
  const LoadResult load = OnLoadResult(n, m);
  if (load == LoadResult::kHandled) return;
  bool bound_elsewhere = load == LoadResult::kBoundElsewhere;
  const std::string& tid = m.transfer_id;
  if (Request* r = FindByTransfer(tid); r != nullptr) {
    if (!r->decode && r->mode == KvMode::kRead) {
      // A read-mode hold: its readers release (a "fail" of theirs changes nothing); anyone
      // else is refused once it has readers.
      if (r->FindReader(n.peer) == nullptr && !r->readers.empty()) RefuseBoundElsewhere(n, m);
      return;
    }
    std::optional<PeerId> bound = r->peer;
    if (!bound) {
      auto e = pushes_.early_writes.find(tid);
      if (e != pushes_.early_writes.end()) bound = e->second.peer;
    }
    if (bound == n.peer) {
      if (r->mode == KvMode::kWrite) AbortLocked(*r, "aborted by decode");
      return;
    }
    if (!bound && m.unread && r->mode == KvMode::kWrite) {
      // Write mode, before decode sent its blocks: decode will not load (the transfer id,
      // 128 random bits, is the capability to say so).
      ReleaseUnreadLocked(*r, n.peer, m.reason);
      return;
    }
    bound_elsewhere = bound_elsewhere || bound.has_value();
  } else if (auto e = pushes_.early_writes.find(tid); e != pushes_.early_writes.end()) {
    if (e->second.peer == n.peer) {
      pushes_.early_writes.erase(e);  // decode gave up before this prefill saw the request
      return;
    }
    bound_elsewhere = true;
  } else if (m.unread) {
    // Write mode: decode will not load (its prefix cache holds the prompt, or it has one token)
    // and says so before this prefill has seen the request. Kept with the early releases
    // (bounded, the oldest dropped), so that the request ends as soon as it is saved here
    // (MaybeSendLayersLocked) instead of holding its blocks until request_timeout.
    connector_internal::RememberEarlyRelease(
        table_.early_releases, table_.early_release_order, tid,
        EarlyRelease{n.peer, {1, 0}, false, true, m.reason.substr(0, 256)});
    return;
  }
  if (bound_elsewhere) RefuseBoundElsewhere(n, m);
  // Else: a transfer that ended here already (or never was): nothing to do.
}

void Connector::Impl::OnHello(PeerId peer, PeerMessage& m) {
  Peer& p = sessions_.peers[peer];
  p.id = peer;
  absl::Status s = NegotiateKvMode(options_.mode, m.mode).status();
  if (s.ok()) s = CheckCompatible(layout_, m.layout);
  json reply;
  if (s.ok()) {
    p.engine_id = std::move(m.engine_id);
    p.layout = std::move(m.layout);
    p.regions = std::move(m.regions);
    p.ready = true;
    p.decode_mode = m.mode;
    p.prefill_mode = options_.mode;
    reply = HelloBody();
    reply["t"] = "hello_ack";
  } else {
    p.error = std::string(s.message());
    reply = {{"t", "hello_err"}, {"error", p.error}};
    KVW_LOG(kWarning, kLog) << "refusing connector peer" << Kv("peer", peer) << Kv("error", s);
  }
  (void)SendMessage(peer, reply);
}

bool Connector::Impl::CheckBinding(Request& r, PeerId peer, const std::string& name,
                                   const PeerMessage& m, bool bind) {
  std::optional<PeerId> bound = r.peer;
  if (!bound) {
    // A write request kept before the scheduler saw the request binds it already.
    auto e = pushes_.early_writes.find(r.params.transfer_id);
    if (e != pushes_.early_writes.end()) bound = e->second.peer;
  }
  if (bound && *bound != peer) {
    ClosePeerLocked(peer, name,
                    absl::PermissionDeniedError(absl::StrCat("connector message '", m.name,
                                                             "' for transfer ", m.transfer_id,
                                                             ", which is bound to another peer")));
    return false;
  }
  if (!bound && bind) r.peer = peer;
  return true;
}

void Connector::Impl::ClosePeerLocked(PeerId peer, const std::string& name, absl::Status reason) {
  KVW_LOG(kWarning, kLog) << "closing connector peer" << Kv("peer", peer) << Kv("name", name)
                          << Kv("reason", reason);
  if (sessions_.dead.Insert(peer)) {
    // Its requests end now, before anything else it sent is looked at.
    OnPeerDeath(peer, name, std::string(reason.message()));
  }
  sessions_.to_close.emplace_back(peer, std::move(reason));
}

void Connector::Impl::CloseQueuedPeers() {
  std::vector<std::pair<PeerId, absl::Status>> peers;
  {
    MutexLock lock(&mu_);
    peers.swap(sessions_.to_close);
  }
  for (const auto& [peer, reason] : peers) (void)engine_->Disconnect(peer, reason);
}

// --- progress ---------------------------------------------------------------------------
// Nothing is polled: the thread sleeps on the progress signal until the engine pushes a
// transfer's end or an inbox event, an API call changes requests, or the next deadline falls
// due (NextWakeLocked).
void Connector::Impl::ProgressLoop() {
  absl::Time wake = absl::Now();
  while (true) {
    connector_internal::ProgressSignal::Wakeup woke = signal_->Wait(wake);
    std::vector<InboxEvent> events = inbox_->Take();
    WaitForServedOps(events);
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      for (const InboxEvent& e : events) {
        if (e.kind == InboxEvent::Kind::kMessage) {
          OnMessage(e);
        } else if (sessions_.dead.Insert(e.peer)) {
          OnPeerDeath(e.peer, e.peer_name, e.payload);
        }
      }
      ServePendingHellos();
      for (const connector_internal::ProgressSignal::EndedTransfer& t : woke.ended) {
        OnTransferEnded(t.id, t.status);
      }
      CheckDeadlines();
      wake = NextWakeLocked();
    }
    CloseQueuedPeers();
  }
}

absl::Time Connector::Impl::NextWakeLocked() const {
  // Idle: nothing is due; the wait is still bounded.
  constexpr absl::Duration kIdleWake = absl::Minutes(1);
  // A hello waits for the sender's regions to arrive in the engine, which raises no event
  // the connector can wait on: checked this often while one waits (handshakes only).
  constexpr absl::Duration kHelloCheck = absl::Milliseconds(2);
  const absl::Time now = absl::Now();
  absl::Time wake = now + kIdleWake;
  if (!sessions_.pending_hellos.empty()) wake = std::min(wake, now + kHelloCheck);
  for (const auto& [tid, e] : pushes_.early_writes) wake = std::min(wake, e.expires);
  for (const auto& [tid, e] : table_.early_reads) wake = std::min(wake, e.expires);
  for (const auto& [id, r] : table_.requests) {
    // A request with transfers in flight waits for their ends (each has a deadline of its
    // own in the engine); CheckDeadlines acts on the others, except matched and pending ones
    // (the scheduler has not started them): their deadline would stay in the past and spin
    // this loop.
    if (r.transfers.empty() && r.state != State::kMatched && r.state != State::kPending) {
      wake = std::min(wake, r.deadline);
    }
  }
  // CheckDeadlines acts on deadlines strictly in the past.
  return wake + absl::Microseconds(1);
}

// A peer's messages (and its death) are handled only once the ops it sent this engine before
// them have been served: its release of blocks it read can overtake the serving thread's last
// access to them (the ops and the messages travel on different connections), and the blocks
// must not be handed back for reuse before that. A legitimate peer's release follows the end of
// its ops by microseconds; the wait is bounded by kServedOpsWait per batch so that a peer that
// keeps an op stalled (its reader does not drain) delays the other peers' messages by at most
// that much; past it they are handled anyway, loudly.
void Connector::Impl::WaitForServedOps(const std::vector<InboxEvent>& events) {
  constexpr absl::Duration kServedOpsWait = absl::Milliseconds(250);
  const absl::Time deadline = absl::Now() + kServedOpsWait;
  std::vector<PeerId> peers;
  for (const InboxEvent& e : events) {
    if (std::find(peers.begin(), peers.end(), e.peer) == peers.end()) peers.push_back(e.peer);
  }
  for (PeerId peer : peers) {
    absl::Status s =
        engine_->WaitForServedOps(peer, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!s.ok()) {
      KVW_LOG(kWarning, kLog) << "handling a peer's messages while its ops are still served"
                              << Kv("peer", peer) << Kv("error", s.message());
    }
  }
}

// A hello names the regions the sender exported; they become usable here asynchronously.
// It is answered once they all arrived (or at its deadline), checked on every turn of the
// progress loop rather than waited for: a hello naming regions that never come must not stall
// the other peers' requests.
void Connector::Impl::ServePendingHellos() {
  const absl::Time now = absl::Now();
  for (auto it = sessions_.pending_hellos.begin(); it != sessions_.pending_hellos.end();) {
    PendingHello& h = *it;
    if (!PeerAlive(h.peer)) {
      it = sessions_.pending_hellos.erase(it);
      continue;
    }
    // The answer lets the sender start writing here: our data path to it must be up too.
    // Its regions having arrived implies that; a sender without regions is looked up by name.
    bool ready = false;
    if (h.msg.regions.empty()) {
      ready = engine_->FindPeer(h.name).ok();
    } else {
      // A zero timeout checks without waiting (set up, and every region resolved).
      ready = std::all_of(h.msg.regions.begin(), h.msg.regions.end(), [&](const RegionSpan& r) {
        return engine_->WaitForRemoteRegion(h.peer, r.id, absl::ZeroDuration()).ok();
      });
    }
    if (!ready && now < h.deadline) {
      ++it;
      continue;
    }
    if (!ready) {
      KVW_LOG(kWarning, kLog) << "hello names regions (or a data path) that never arrived"
                              << Kv("peer", h.peer) << Kv("name", h.name);
    }
    PendingHello done = std::move(h);
    it = sessions_.pending_hellos.erase(it);
    OnHello(done.peer, done.msg);
  }
}

// The engine closed `peer` (lease expiry, Goodbye, I/O error): every request bound to it
// fails now, not at its deadline.
void Connector::Impl::OnPeerDeath(PeerId peer, const std::string& name, const std::string& reason) {
  KVW_LOG(kWarning, kLog) << "peer died" << Kv("peer", peer) << Kv("name", name)
                          << Kv("reason", reason);
  for (auto& [address, id] : sessions_.by_address) {
    if (id == peer) {
      sessions_.by_address.erase(address);
      break;
    }
  }
  // Forgotten (its layout and regions are not kept for a connection that is gone); a handshake
  // waiting on it ends now, and requests bound to it find it missing.
  sessions_.peers.erase(peer);
  sessions_.pending_hellos.erase(
      std::remove_if(sessions_.pending_hellos.begin(), sessions_.pending_hellos.end(),
                     [&](const PendingHello& h) { return h.peer == peer; }),
      sessions_.pending_hellos.end());
  cv_.SignalAll();
  std::vector<std::string> ids, read_holds;
  for (auto& [id, r] : table_.requests) {
    if (!r.decode && r.mode == KvMode::kRead) {
      if (r.FindReader(peer) != nullptr) read_holds.push_back(id);
      continue;
    }
    bool bound = r.peer == peer;
    for (const auto& [source, tid] : r.tp_sources) bound = bound || source == peer;
    if (bound) ids.push_back(id);
  }
  for (const std::string& id : ids) {
    auto it = table_.requests.find(id);
    if (it == table_.requests.end()) continue;
    Request& r = it->second;
    // Not marked abort_sent: other sources of a multi-rank read still get their release
    // (TellPeer skips dead peers).
    FailLocked(r, absl::StrCat("peer ", name, " died: ", reason));
  }
  // A held hand-off's other readers may still be reading: this one is done, failed. (Its
  // grant is revoked with the others': a peer closed here is disconnected only later.)
  for (const std::string& id : read_holds) {
    auto it = table_.requests.find(id);
    if (it == table_.requests.end()) continue;
    ReaderDoneLocked(it->second, peer, ReadEnd::kFailed,
                     absl::StrCat("peer ", name, " died: ", reason));
  }
}

}  // namespace kvwire
