// Connector peers: the handshake (hello / hello_ack / hello_err: layouts, regions, modes),
// the messages of running requests, peer deaths, and the progress thread that drives them.
#include <algorithm>
#include <iterator>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

using connector_internal::kLog;
using connector_internal::LayoutFromJsonValue;
using connector_internal::LayoutToJsonValue;
using nlohmann::json;

namespace connector_internal {

absl::StatusOr<PeerMessage> ParsePeerMessage(const std::string& payload) {
  absl::StatusOr<json> j = ParseJsonObject(payload, "connector message");
  if (!j.ok()) return j.status();
  PeerMessage m;
  {
    JsonFields head(*j, "connector message");
    m.name = head.String("t", 32);
    if (!head.ok()) return head.status();
  }
  using Type = PeerMessage::Type;
  static constexpr std::pair<const char*, Type> kTypes[] = {
      {"hello", Type::kHello},        {"hello_ack", Type::kHelloAck},
      {"hello_err", Type::kHelloErr}, {"read_start", Type::kReadStart},
      {"release", Type::kRelease},    {"write_req", Type::kWriteReq},
      {"layer", Type::kLayer},        {"done", Type::kDone},
      {"fail", Type::kFail}};
  auto type = std::find_if(std::begin(kTypes), std::end(kTypes),
                           [&](const auto& t) { return m.name == t.first; });
  if (type == std::end(kTypes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("connector message of unknown type '", m.name, "'"));
  }
  m.type = type->second;
  JsonFields f(*j, absl::StrCat("connector message '", m.name, "'"));
  switch (m.type) {
    case Type::kHello:
    case Type::kHelloAck: {
      m.engine_id = f.String("engine_id", 256);
      const std::string mode = f.OptString("mode", "auto", 16);
      if (absl::StatusOr<KvMode> k = ParseKvMode(mode); k.ok()) {
        m.mode = *k;
      } else {
        f.Fail("mode", absl::StrCat("must be read, write or auto, got \"", mode, "\""));
      }
      if (const json* layout = f.Object("layout", /*required=*/true); layout != nullptr) {
        absl::StatusOr<Layout> l = LayoutFromJsonValue(*layout);
        if (l.ok()) {
          m.layout = std::move(*l);
        } else {
          f.Fail("layout", absl::StrCat("is not usable: ", l.status().message()));
        }
      }
      const json* regions = f.Array("regions", /*required=*/true, kMaxRegions);
      for (size_t i = 0; regions != nullptr && i < regions->size() && f.ok(); ++i) {
        const json& r = (*regions)[i];
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
      break;
    }
    case Type::kHelloErr:
      m.reason = f.OptString("error", "?", kMaxReasonBytes);
      break;
    case Type::kReadStart:
    case Type::kRelease:
    case Type::kWriteReq:
    case Type::kLayer:
    case Type::kDone:
    case Type::kFail:
      m.transfer_id = f.String("transfer_id", kMaxTransferIdBytes);
      if (f.ok() && m.transfer_id.empty()) f.Fail("transfer_id", "is empty");
      if (m.type == Type::kRelease) m.ok = f.OptBool("ok", true);
      if (m.type == Type::kRelease || m.type == Type::kFail) {
        m.reason = f.OptString("reason", "?", kMaxReasonBytes);
      }
      if (m.type == Type::kWriteReq) {
        m.blocks = BlocksFromJson(f, "blocks", /*required=*/true);
        m.num_cached = f.OptUint("num_cached", uint64_t{1} << 40, 0);
      }
      if (m.type == Type::kLayer) m.layer = static_cast<int>(f.Int("layer", 0, 1 << 30));
      if (m.type == Type::kDone) (void)f.OptUint("bytes", std::numeric_limits<uint64_t>::max(), 0);
      break;
  }
  if (!f.ok()) return f.status();
  return m;
}

}  // namespace connector_internal

nlohmann::json Connector::Impl::HelloBody() const {
  json regions = json::array();
  for (const RegionSpan& r : local_regions_) regions.push_back({r.base, r.length, r.id});
  return {{"engine_id", engine_->name()},
          {"mode", KvModeName(options_.mode)},
          {"layout", LayoutToJsonValue(layout_)},
          {"regions", regions}};
}

// Decode: connects to the prefill engine at `address` and runs the connector handshake.
absl::StatusOr<PeerId> Connector::Impl::EnsurePeer(const std::string& address) {
  {
    MutexLock lock(&mu_);
    auto it = peer_by_address_.find(address);
    if (it != peer_by_address_.end()) {
      auto p = peers_.find(it->second);
      if (p != peers_.end() && p->second.ready) return p->second.id;
      if (p != peers_.end() && !p->second.error.empty()) {
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
      Peer& p = peers_[id];
      p.id = id;
      p.address = address;
    }
    peer_by_address_[address] = id;
    json hello = HelloBody();
    hello["t"] = "hello";
    if (absl::Status s = SendMessage(id, hello); !s.ok()) return s;
    // Looked up again after every wait: a peer that dies is forgotten (OnPeerDeath).
    std::string error;
    while (true) {
      auto p = peers_.find(id);
      if (p == peers_.end()) {
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
        p = peers_.find(id);
        if (p != peers_.end()) p->second.error = error;
        break;
      }
    }
    if (!error.empty()) {
      if (auto a = peer_by_address_.find(address); a != peer_by_address_.end() && a->second == id) {
        peer_by_address_.erase(a);
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

void Connector::Impl::OnMessage(const InboxEvent& n) {
  using Type = connector_internal::PeerMessage::Type;
  if (!PeerAlive(n.peer)) return;  // closed here earlier in this batch
  absl::StatusOr<connector_internal::PeerMessage> parsed =
      connector_internal::ParsePeerMessage(n.payload);
  if (!parsed.ok()) {
    ClosePeerLocked(n.peer, n.peer_name, parsed.status());
    return;
  }
  connector_internal::PeerMessage& m = *parsed;
  auto pit = peers_.find(n.peer);
  if (m.type == Type::kHello) {
    const bool pending = std::any_of(pending_hellos_.begin(), pending_hellos_.end(),
                                     [&](const PendingHello& h) { return h.peer == n.peer; });
    if (pit != peers_.end() || pending) {
      ClosePeerLocked(n.peer, n.peer_name,
                      absl::FailedPreconditionError(
                          "connector message 'hello' repeated or unexpected (the connector "
                          "handshake runs once per connection, from the dialing side)"));
      return;
    }
    pending_hellos_.push_back(
        {n.peer, n.peer_name, std::move(m), absl::Now() + options_.handshake_timeout});
    return;
  }
  if (m.type == Type::kHelloAck || m.type == Type::kHelloErr) {
    // Only the answer to our own hello, once.
    if (pit == peers_.end() || pit->second.address.empty() || pit->second.ready ||
        !pit->second.error.empty()) {
      ClosePeerLocked(n.peer, n.peer_name,
                      absl::FailedPreconditionError(absl::StrCat(
                          "connector message '", m.name, "' without a hello of ours to answer")));
      return;
    }
    Peer& p = pit->second;
    if (m.type == Type::kHelloErr) {
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
    return;
  }
  if (pit == peers_.end() || !pit->second.ready) {
    ClosePeerLocked(n.peer, n.peer_name,
                    absl::FailedPreconditionError(absl::StrCat(
                        "connector message '", m.name, "' before the connector handshake")));
    return;
  }
  const std::string& tid = m.transfer_id;
  switch (m.type) {
    case Type::kWriteReq:
      OnWriteRequest(n.peer, n.peer_name, m);
      return;
    case Type::kReadStart: {
      // Decode is about to READ: bind the held blocks to it, so that its death frees them at
      // once rather than at the end of the lease, and nobody else can release them.
      Request* r = FindByTransfer(tid);
      if (r == nullptr) return;  // ended here already
      if (r->mode != KvMode::kRead) {
        ClosePeerLocked(n.peer, n.peer_name,
                        absl::FailedPreconditionError(
                            absl::StrCat("connector message 'read_start' for transfer ", tid,
                                         ", which is not a read-mode hand-off")));
        return;
      }
      (void)CheckBinding(*r, n.peer, n.peer_name, m, /*bind=*/r->state == State::kHeld);
      return;
    }
    case Type::kRelease: {
      Request* r = FindByTransfer(tid);
      if (r == nullptr) {
        // Ended here already, or not held yet (see early_releases_): kept for a while.
        // The reason is cut short: thousands of these may wait.
        if (early_releases_.emplace(tid, EarlyRelease{n.peer, m.ok, m.reason.substr(0, 256)})
                .second) {
          early_release_order_.push_back(tid);
          if (early_release_order_.size() > connector_internal::kMaxEarlyReleases) {
            early_releases_.erase(early_release_order_.front());
            early_release_order_.pop_front();
          }
        }
        return;
      }
      if (r->mode != KvMode::kRead) {
        ClosePeerLocked(n.peer, n.peer_name,
                        absl::FailedPreconditionError(
                            absl::StrCat("connector message 'release' for transfer ", tid,
                                         ", which is not a read-mode hand-off")));
        return;
      }
      if (!CheckBinding(*r, n.peer, n.peer_name, m, /*bind=*/true)) return;
      if (m.ok) {
        CompleteLocked(*r);
      } else {
        FailLocked(*r, absl::StrCat("reader failed: ", m.reason));
      }
      return;
    }
    default:
      break;
  }
  // layer, done, fail. Decode side first: results of a write-mode load (or prefill stopping),
  // accepted only from the prefill the load is bound to.
  Request* d = nullptr;
  std::optional<PeerId> d_peer;
  for (auto& [id, r] : requests_) {
    if (!r.decode) continue;
    if (r.params.transfer_id == tid) {
      d = &r;
      d_peer = r.peer;
      break;
    }
    for (const auto& [source, source_tid] : r.tp_sources) {
      if (source_tid == tid) {
        d = &r;
        d_peer = source;
      }
    }
    if (d != nullptr) break;
  }
  if (d != nullptr && d_peer == n.peer) {
    Request& r = *d;
    // Read mode: prefill's "fail" (its lease ended) changes nothing here; the READs fail.
    if (r.mode != KvMode::kWrite) return;
    if (r.state != State::kLoading && r.state != State::kDraining) return;
    if (m.type == Type::kLayer) {
      r.layers_pending.erase(m.layer);
      cv_.SignalAll();  // WaitForLayerLoad
    } else if (m.type == Type::kDone && r.state == State::kLoading && r.fail_reason.empty()) {
      CompleteLocked(r);
    } else {
      r.abort_sent = true;  // prefill writes nothing more
      FailLocked(r, r.fail_reason.empty() ? absl::StrCat("prefill: ", m.reason) : r.fail_reason);
    }
    return;
  }
  bool bound_elsewhere = d != nullptr;
  if (m.type == Type::kFail) {
    // Prefill side: decode aborted a write-mode transfer. Stop sending; answer when nothing
    // is in flight.
    if (Request* r = FindByTransfer(tid); r != nullptr) {
      std::optional<PeerId> bound = r->peer;
      if (!bound) {
        auto e = early_writes_.find(tid);
        if (e != early_writes_.end()) bound = e->second.peer;
      }
      if (bound == n.peer) {
        if (r->mode == KvMode::kWrite) AbortLocked(*r, "aborted by decode");
        return;
      }
      bound_elsewhere = bound_elsewhere || bound.has_value();
    } else if (auto e = early_writes_.find(tid); e != early_writes_.end()) {
      if (e->second.peer == n.peer) {
        early_writes_.erase(e);  // decode gave up before this prefill saw the request
        return;
      }
      bound_elsewhere = true;
    }
  }
  if (bound_elsewhere) {
    ClosePeerLocked(
        n.peer, n.peer_name,
        absl::PermissionDeniedError(absl::StrCat("connector message '", m.name, "' for transfer ",
                                                 tid, ", which is bound to another peer")));
  }
  // Else: a transfer that ended here already (or never was): nothing to do.
}

void Connector::Impl::OnHello(PeerId peer, connector_internal::PeerMessage& m) {
  Peer& p = peers_[peer];
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
                                   const connector_internal::PeerMessage& m, bool bind) {
  std::optional<PeerId> bound = r.peer;
  if (!bound) {
    // A write request kept before the scheduler saw the request binds it already.
    auto e = early_writes_.find(r.params.transfer_id);
    if (e != early_writes_.end()) bound = e->second.peer;
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
  if (dead_peers_.Insert(peer)) {
    // Its requests end now, before anything else it sent is looked at.
    OnPeerDeath(peer, name, std::string(reason.message()));
  }
  peers_to_close_.emplace_back(peer, std::move(reason));
}

void Connector::Impl::CloseQueuedPeers() {
  std::vector<std::pair<PeerId, absl::Status>> peers;
  {
    MutexLock lock(&mu_);
    peers.swap(peers_to_close_);
  }
  for (const auto& [peer, reason] : peers) (void)engine_->Disconnect(peer, reason);
}

// --- progress ---------------------------------------------------------------------------
void Connector::Impl::ProgressLoop() {
  while (true) {
    std::vector<InboxEvent> events = inbox_->Wait(absl::Milliseconds(2));
    WaitForServedOps(events);
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      for (const InboxEvent& e : events) {
        if (e.kind == InboxEvent::Kind::kMessage) {
          OnMessage(e);
        } else if (dead_peers_.Insert(e.peer)) {
          OnPeerDeath(e.peer, e.peer_name, e.payload);
        }
      }
      ServePendingHellos();
      PollTransfers();
      CheckDeadlines();
    }
    CloseQueuedPeers();
  }
}

// A peer's messages (and its death) are handled only once the ops it sent this engine before
// them have been served: its release of blocks it read can overtake the serving thread's last
// access to them (the ops and the messages travel on different connections), and the blocks
// must not be handed back for reuse before that. Bounded by the tcp transport's own cut of a
// stalled data connection (which ends its ops); past that they are handled anyway, loudly.
void Connector::Impl::WaitForServedOps(const std::vector<InboxEvent>& events) {
  std::vector<PeerId> peers;
  for (const InboxEvent& e : events) {
    if (std::find(peers.begin(), peers.end(), e.peer) == peers.end()) peers.push_back(e.peer);
  }
  for (PeerId peer : peers) {
    absl::Status s =
        engine_->WaitForServedOps(peer, options_.engine.tcp_io_timeout + absl::Seconds(1));
    if (!s.ok()) {
      KVW_LOG(kError, kLog) << "handling a peer's messages while its ops are still served"
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
  for (auto it = pending_hellos_.begin(); it != pending_hellos_.end();) {
    PendingHello& h = *it;
    if (!PeerAlive(h.peer)) {
      it = pending_hellos_.erase(it);
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
    it = pending_hellos_.erase(it);
    OnHello(done.peer, done.msg);
  }
}

// The engine closed `peer` (lease expiry, Goodbye, I/O error): every request bound to it
// fails now, not at its deadline.
void Connector::Impl::OnPeerDeath(PeerId peer, const std::string& name, const std::string& reason) {
  KVW_LOG(kWarning, kLog) << "peer died" << Kv("peer", peer) << Kv("name", name)
                          << Kv("reason", reason);
  for (auto& [address, id] : peer_by_address_) {
    if (id == peer) {
      peer_by_address_.erase(address);
      break;
    }
  }
  // Forgotten (its layout and regions are not kept for a connection that is gone); a handshake
  // waiting on it ends now, and requests bound to it find it missing.
  peers_.erase(peer);
  pending_hellos_.erase(std::remove_if(pending_hellos_.begin(), pending_hellos_.end(),
                                       [&](const PendingHello& h) { return h.peer == peer; }),
                        pending_hellos_.end());
  cv_.SignalAll();
  std::vector<std::string> ids;
  for (auto& [id, r] : requests_) {
    bool bound = r.peer == peer;
    for (const auto& [source, tid] : r.tp_sources) bound = bound || source == peer;
    if (bound) ids.push_back(id);
  }
  for (const std::string& id : ids) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    Request& r = it->second;
    // Not marked abort_sent: other sources of a multi-rank read still get their release
    // (TellPeer skips dead peers).
    FailLocked(r, absl::StrCat("peer ", name, " died: ", reason));
  }
}

}  // namespace kvwire
