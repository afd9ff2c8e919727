// Connector peers: the handshake (hello / hello_ack / hello_err: layouts, regions, modes),
// the messages of running requests, peer deaths, and the progress thread that drives them.
#include <algorithm>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

using connector_internal::BlocksFromJson;
using connector_internal::BlocksToJson;
using connector_internal::CpuTimer;
using connector_internal::FindRegion;
using connector_internal::kLog;
using connector_internal::LayoutFromJsonValue;
using connector_internal::LayoutToJsonValue;
using connector_internal::Us;
using nlohmann::json;

nlohmann::json Connector::Impl::HelloBody() const {
  json regions = json::array();
  for (const RegionSpan& r : local_regions_) regions.push_back({r.base, r.length, r.id});
  return {{"engine_id", engine_->name()},
          {"mode", KvModeName(options_.mode)},
          {"layout", LayoutToJsonValue(layout_)},
          {"regions", regions}};
}

absl::Status Connector::Impl::ReadHello(const json& m, Peer* p) {
  try {
    p->engine_id = m.at("engine_id").get<std::string>();
    absl::StatusOr<Layout> layout = LayoutFromJsonValue(m.at("layout"));
    if (!layout.ok()) return layout.status();
    p->layout = std::move(*layout);
    p->regions.clear();
    for (const json& r : m.at("regions")) {
      p->regions.push_back(
          {r.at(0).get<uint64_t>(), r.at(1).get<uint64_t>(), r.at(2).get<uint64_t>()});
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad hello: ", e.what()));
  }
  return absl::OkStatus();
}

// Decode: connects to the prefill engine at `address` and runs the connector handshake.
absl::StatusOr<PeerId> Connector::Impl::EnsurePeer(const std::string& address) {
  {
    MutexLock lock(&mu_);
    auto it = peer_by_address_.find(address);
    if (it != peer_by_address_.end()) {
      Peer& p = peers_[it->second];
      if (p.ready) return p.id;
      if (!p.error.empty()) return absl::FailedPreconditionError(p.error);
    }
  }
  absl::StatusOr<PeerId> peer = engine_->Connect(address);
  if (!peer.ok()) return peer.status();
  const absl::Time deadline = absl::Now() + options_.handshake_timeout;
  const PeerId id = *peer;
  std::vector<RegionId> regions;
  {
    MutexLock lock(&mu_);
    Peer& p = peers_[id];
    p.id = id;
    p.address = address;
    peer_by_address_[address] = id;
    json hello = HelloBody();
    hello["t"] = "hello";
    if (absl::Status s = SendMessage(id, hello); !s.ok()) return s;
    while (!p.ready && p.error.empty()) {
      if (!cv_.WaitUntil(&mu_, deadline) && absl::Now() >= deadline) {
        p.error = absl::StrCat("connector handshake with ", address,
                               " timed out (is it a kvwire connector?)");
        break;
      }
    }
    if (!p.ready) {
      peer_by_address_.erase(address);
      return absl::FailedPreconditionError(p.error);
    }
    for (const RegionSpan& r : p.regions) regions.push_back(r.id);
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
  json m = json::parse(n.payload, nullptr, false);
  if (m.is_discarded() || !m.is_object()) {
    KVW_LOG(kWarning, kLog) << "ignoring malformed message" << Kv("peer", n.peer);
    return;
  }
  const std::string type = m.value("t", "");
  if (type == "hello") {
    Peer& p = peers_[n.peer];
    p.id = n.peer;
    json reply;
    absl::Status s = ReadHello(m, &p);
    absl::StatusOr<KvMode> mode = KvMode::kAuto;
    if (s.ok()) {
      absl::StatusOr<KvMode> dm = ParseKvMode(m.value("mode", "auto"));
      mode = dm.ok() ? NegotiateKvMode(options_.mode, *dm) : dm;
      if (!mode.ok()) s = mode.status();
    }
    if (s.ok()) s = CheckCompatible(layout_, p.layout);
    if (s.ok()) {
      reply = HelloBody();
      reply["t"] = "hello_ack";
      p.ready = true;
      p.decode_mode = *ParseKvMode(m.value("mode", "auto"));
      p.prefill_mode = options_.mode;
    } else {
      reply = {{"t", "hello_err"}, {"error", std::string(s.message())}};
      KVW_LOG(kWarning, kLog) << "refusing connector peer" << Kv("peer", n.peer) << Kv("error", s);
    }
    (void)SendMessage(n.peer, reply);
    return;
  }
  if (type == "hello_ack" || type == "hello_err") {
    auto it = peers_.find(n.peer);
    if (it == peers_.end()) return;
    Peer& p = it->second;
    if (type == "hello_err") {
      p.error =
          absl::StrCat("prefill engine refused the connector handshake: ", m.value("error", "?"));
    } else {
      absl::Status s = ReadHello(m, &p);
      if (s.ok()) s = CheckCompatible(p.layout, layout_);
      if (s.ok()) {
        p.ready = true;
        p.decode_mode = options_.mode;
        p.prefill_mode = *ParseKvMode(m.value("mode", "auto"));
      } else {
        p.error = std::string(s.message());
      }
    }
    cv_.SignalAll();
    return;
  }
  const std::string tid = m.value("transfer_id", "");
  if (type == "write_req") {
    OnWriteRequest(n.peer, m);
    return;
  }
  if (type == "read_start") {
    // Decode is about to READ: bind the held blocks to it, so that its death frees them at
    // once rather than at the end of the lease.
    Request* r = FindByTransfer(tid);
    if (r != nullptr && !r->decode && r->mode == KvMode::kRead && r->state == State::kHeld) {
      r->peer = n.peer;
    }
    return;
  }
  if (type == "release") {
    auto r = FindByTransfer(tid);
    if (r != nullptr && !r->decode && r->mode == KvMode::kRead) {
      if (m.value("ok", true)) {
        CompleteLocked(*r);
      } else {
        FailLocked(*r, absl::StrCat("reader failed: ", m.value("reason", "?")));
      }
    }
    return;
  }
  // Decode side: results of a write-mode load, or prefill stopping.
  for (auto& [id, r] : requests_) {
    if (!r.decode || r.params.transfer_id != tid || r.mode != KvMode::kWrite) continue;
    if (r.state != State::kLoading && r.state != State::kDraining) break;
    if (type == "layer") {
      r.layers_pending.erase(m.value("layer", -1));
      cv_.SignalAll();  // WaitForLayerLoad
      return;
    }
    if (type == "done" && r.state == State::kLoading && r.fail_reason.empty()) {
      CompleteLocked(r);
    } else if (type == "done" || type == "fail") {
      r.abort_sent = true;  // prefill writes nothing more
      FailLocked(r, r.fail_reason.empty() ? absl::StrCat("prefill: ", m.value("reason", "?"))
                                          : r.fail_reason);
    }
    return;
  }
  if (type == "fail") {
    // Decode aborted a write-mode transfer: stop sending; answer when nothing is in flight.
    Request* r = FindByTransfer(tid);
    if (r != nullptr && !r->decode) AbortLocked(*r, "aborted by decode");
  }
}

// --- progress ---------------------------------------------------------------------------
void Connector::Impl::ProgressLoop() {
  while (true) {
    std::vector<InboxEvent> events = inbox_->Wait(absl::Milliseconds(2));
    for (const InboxEvent& e : events) {
      if (e.kind == InboxEvent::Kind::kMessage) WaitForHelloRegions(e);
    }
    MutexLock lock(&mu_);
    if (stop_) return;
    for (const InboxEvent& e : events) {
      if (e.kind == InboxEvent::Kind::kMessage) {
        OnMessage(e);
      } else if (dead_peers_.insert(e.peer).second) {
        OnPeerDeath(e.peer, e.peer_name, e.payload);
      }
    }
    PollTransfers();
    CheckDeadlines();
  }
}

// A hello names the regions the sender exported; they become usable here asynchronously,
// so wait (bounded) before answering.
void Connector::Impl::WaitForHelloRegions(const InboxEvent& n) {
  if (n.payload.find("\"hello\"") == std::string::npos) return;
  json m = json::parse(n.payload, nullptr, false);
  if (m.is_discarded() || !m.is_object() || m.value("t", "") != "hello") return;
  const absl::Time deadline = absl::Now() + options_.handshake_timeout;
  std::vector<RegionId> ids;
  try {
    for (const json& r : m.at("regions")) ids.push_back(r.at(2).get<uint64_t>());
  } catch (const json::exception&) {
    return;  // OnMessage reports it
  }
  // The answer lets the sender start writing here: our data path to it must be up too.
  // Waiting for its regions implies that; a sender without regions is looked up by name.
  if (absl::StatusOr<PeerId> up =
          ids.empty() ? engine_->WaitForPeer(n.peer_name, deadline - absl::Now()) : n.peer;
      !up.ok()) {
    KVW_LOG(kWarning, kLog) << "data path to a connector peer never came up" << Kv("peer", n.peer)
                            << Kv("error", up.status());
    return;
  }
  for (RegionId id : ids) {
    absl::Status s = engine_->WaitForRemoteRegion(
        n.peer, id, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!s.ok()) {
      KVW_LOG(kWarning, kLog) << "hello names a region that never arrived" << Kv("peer", n.peer)
                              << Kv("region", id) << Kv("error", s);
      return;
    }
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
  auto p = peers_.find(peer);
  if (p != peers_.end()) {
    if (p->second.error.empty()) p->second.error = absl::StrCat("peer ", name, " died: ", reason);
    cv_.SignalAll();  // a handshake waiting on it ends now
  }
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
