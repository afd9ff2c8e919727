// Connector peers: the handshake (hello / hello_ack / hello_err: layouts, regions, modes),
// hellos waiting for their regions, protocol closes, and peer deaths.
#include <algorithm>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

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
  std::string hello_payload;
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
    hello_payload = DumpJson(hello);
  }
  // Outside the lock (no engine call is made under it); the answer finds the peer registered.
  if (absl::Status s =
          engine_->SendMessage(id, connector_internal::kTopic, std::move(hello_payload));
      !s.ok()) {
    return s;
  }
  {
    MutexLock lock(&mu_);
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
    StepLocked(r, Event::kPeerGone);
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
