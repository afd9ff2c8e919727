// Peers: handshake on both sides, exports, the control messages of a live peer, data-path
// setup (which transport reaches which region), and teardown.
#include <algorithm>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/control/handshake.h"
#include "src/core/engine_impl.h"
#include "src/util/log.h"

namespace kvwire {
namespace {

// Regions one peer may export to this engine; a KV cache needs a few hundred at most.
constexpr size_t kMaxRemoteRegionsPerPeer = 1 << 16;

TransportKind PreferenceOf(const pb::Hello& hello) {
  auto kind = ParseTransportKind(hello.transport_preference());
  return kind.ok() ? *kind : TransportKind::kAuto;
}

const pb::TransportEndpoint* FindEndpoint(const pb::Hello& hello, const std::string& kind) {
  for (const pb::TransportEndpoint& t : hello.transports()) {
    if (t.kind() == kind) return &t;
  }
  return nullptr;
}

// Both sides may force a transport; they must agree.
absl::StatusOr<TransportKind> SettlePreference(TransportKind local, const std::string& local_name,
                                               TransportKind remote,
                                               const std::string& remote_name) {
  if (local != TransportKind::kAuto && remote != TransportKind::kAuto && local != remote) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport conflict: engine ", local_name, " requires ", TransportKindName(local),
        ", peer ", remote_name, " requires ", TransportKindName(remote)));
  }
  return local != TransportKind::kAuto ? local : remote;
}

pb::RegionDescriptor Describe(const transport::LocalRegion& region) {
  pb::RegionDescriptor d;
  d.set_id(region.id);
  d.set_length(region.length);
  d.set_access(region.access);
  d.set_memory_kind(static_cast<uint32_t>(region.kind));
  d.set_address(reinterpret_cast<uint64_t>(region.base));
  d.set_reads_need_grant(region.reads_need_grant);
  return d;
}

}  // namespace

pb::Hello Engine::Impl::LocalHello(TransportKind preference) const {
  pb::Hello hello;
  hello.set_engine_name(name_);
  hello.set_pid(static_cast<uint32_t>(getpid()));
  hello.set_transport_preference(TransportKindName(preference));
  for (const auto& t : transports_) {
    pb::TransportEndpoint* endpoint = hello.add_transports();
    endpoint->set_kind(t->caps().name);
    endpoint->set_endpoint(t->Endpoint());
  }
  return hello;
}

std::shared_ptr<Peer> Engine::Impl::GetPeer(PeerId id) const {
  MutexLock lock(&peers_mu_);
  auto it = peers_.find(id);
  return it == peers_.end() ? nullptr : it->second;
}

absl::StatusOr<std::string> Engine::Impl::IssueToken() {
  if (stopping_) return absl::UnavailableError(absl::StrCat("engine ", name_, " is stopping"));
  absl::StatusOr<std::string> token = NewToken();
  if (!token.ok()) return token.status();
  const PeerId id = next_peer_id_++;
  MutexLock lock(&peers_mu_);
  if (!tokens_.try_emplace(*token, id).second) {
    return absl::InternalError("the CSPRNG repeated a session token");
  }
  return token;
}

void Engine::Impl::RevokeToken(const std::string& token) {
  PeerId id = 0;
  {
    MutexLock lock(&peers_mu_);
    auto it = tokens_.find(token);
    if (it == tokens_.end()) return;
    id = it->second;
    tokens_.erase(it);
    // A published peer is closed by ClosePeer, which drops it from every transport.
    if (peers_.contains(id)) return;
  }
  // The token was live while its handshake ran (the other side had proven the secret, or none
  // is set), so data connections may have been opened with it: a handshake that then failed
  // must not leave them serving a peer that never was.
  for (const auto& t : transports_) t->DropPeer(id);
}

PeerId Engine::Impl::TokenPeer(const std::string& token) const {
  MutexLock lock(&peers_mu_);
  auto it = tokens_.find(token);
  return it == tokens_.end() ? 0 : it->second;
}

absl::StatusOr<pb::Hello> Engine::Impl::RespondToHello(const pb::Hello& remote) {
  // Runs before the dialer has proven anything: decides, holds no state, issues no token.
  if (stopping_) return absl::UnavailableError(absl::StrCat("engine ", name_, " is stopping"));
  auto preference =
      SettlePreference(options_.transport, name_, PreferenceOf(remote), remote.engine_name());
  if (!preference.ok()) return preference.status();
  return LocalHello(options_.transport);
}

void Engine::Impl::OnAccepted(control::Accepted accepted) {
  const PeerId id = TokenPeer(accepted.local_token);
  if (id == 0 || stopping_) {
    // Revoked meanwhile (the engine is stopping): the dialer learns it from the Goodbye.
    RevokeToken(accepted.local_token);
    accepted.connection->Close(
        absl::UnavailableError(absl::StrCat("engine ", name_, " is stopping")));
    return;
  }
  auto preference = SettlePreference(options_.transport, name_, PreferenceOf(accepted.remote_hello),
                                     accepted.remote_hello.engine_name());
  const std::string address = accepted.connection->remote_address();
  std::shared_ptr<Peer> peer =
      AddPeer(id, address, std::move(accepted), preference.value_or(TransportKind::kAuto));
  worker_->Post([this, peer] {
    if (absl::Status s = SetupChannels(peer); !s.ok()) ClosePeer(peer, s);
  });
}

std::shared_ptr<Peer> Engine::Impl::AddPeer(PeerId id, const std::string& address,
                                            control::Accepted accepted, TransportKind preference) {
  auto peer = std::make_shared<Peer>();
  peer->id = id;
  peer->name = accepted.remote_hello.engine_name();
  peer->address = address;
  peer->hello = std::move(accepted.remote_hello);
  peer->preference = preference;
  peer->conn = std::move(accepted.connection);
  {
    MutexLock lock(&peers_mu_);
    peers_[id] = peer;
    peers_cv_.SignalAll();
  }
  std::weak_ptr<Peer> weak = peer;
  peer->conn->Start(
      [this, weak](const pb::Envelope& message) {
        if (auto p = weak.lock()) OnMessage(p, message);
      },
      [this, weak](const absl::Status& status) {
        auto p = weak.lock();
        if (!p || stopping_) return;
        // Teardown joins transport threads: never on the I/O thread that noticed it.
        worker_->Post([this, p, status] { ClosePeer(p, status); });
      },
      options_.heartbeat_interval, options_.peer_lease);
  (void)SendExports(*peer, regions_.ExportedToAll());
  KVW_LOG(kInfo, "engine") << "peer connected" << Kv("engine", name_) << Kv("peer", id)
                           << Kv("name", peer->name) << Kv("address", address)
                           << Kv("preference", TransportKindName(preference));
  return peer;
}

absl::Status Engine::Impl::SendExports(Peer& peer,
                                       const std::vector<transport::LocalRegion>& regions) {
  if (regions.empty()) return absl::OkStatus();
  pb::Envelope message;
  // A key that failed: the region goes without it (a transport that reaches every region
  // still reaches it).
  absl::Status keys_ok;
  // Keys may cost a registration per peer (rdma): none for a peer that will never use that
  // transport (it offers none, or the pair forced another).
  const std::string forced = ForcedName(peer.preference);
  std::vector<transport::Transport*> keyed;
  for (const auto& t : transports_) {
    if (!forced.empty() && t->caps().name != forced) continue;
    if (FindEndpoint(peer.hello, t->caps().name) == nullptr) continue;
    keyed.push_back(t.get());
  }
  for (const transport::LocalRegion& r : regions) {
    pb::RegionDescriptor* d = message.mutable_export_regions()->add_regions();
    *d = Describe(r);
    for (transport::Transport* t : keyed) {
      absl::StatusOr<std::string> key = t->ExportKey(peer.id, r.id);
      if (key.ok() && !key->empty()) (*d->mutable_transport_keys())[t->caps().name] = *key;
      if (!key.ok() && keys_ok.ok()) {
        keys_ok =
            absl::Status(key.status().code(),
                         absl::StrCat("exporting region ", r.id, " to peer ", peer.name, " over ",
                                      t->caps().name, ": ", key.status().message()));
      }
    }
  }
  {
    // A key made for a peer that closed meanwhile (after ClosePeer's DropPeer) is dropped again.
    MutexLock lock(&peer.mu);
    if (!peer.alive) {
      for (transport::Transport* t : keyed) t->DropPeer(peer.id);
      return absl::UnavailableError(absl::StrCat("peer ", peer.name, " closed"));
    }
  }
  if (!keys_ok.ok()) {
    KVW_LOG(kWarning, "engine") << "export without a transport key" << Kv("engine", name_)
                                << Kv("error", keys_ok.message());
  }
  absl::Status sent = peer.conn->Send(message);
  return sent.ok() ? keys_ok : sent;
}

absl::StatusOr<PeerId> Engine::Impl::Connect(const std::string& address,
                                             const ConnectOptions& options) {
  if (stopping_) return absl::UnavailableError(absl::StrCat("engine ", name_, " is stopping"));
  const TransportKind preference = options.transport.value_or(options_.transport);
  // The handshake issues this side's token only once the listener is authenticated, and
  // revokes it itself if the handshake fails.
  auto accepted = control::Dial(io_, address, LocalHello(preference), handshake_);
  if (!accepted.ok()) {
    return absl::Status(accepted.status().code(),
                        absl::StrCat("connect to ", address, ": ", accepted.status().message()));
  }
  const std::string token = accepted->local_token;
  auto forget_token = [&] { RevokeToken(token); };
  const PeerId id = TokenPeer(token);
  if (id == 0) {
    const absl::Status stopping = absl::UnavailableError(
        absl::StrCat("connect to ", address, ": engine ", name_, " is stopping"));
    accepted->connection->Close(stopping);
    return stopping;
  }
  auto settled = SettlePreference(preference, name_, PreferenceOf(accepted->remote_hello),
                                  accepted->remote_hello.engine_name());
  if (!settled.ok()) {
    accepted->connection->Close(settled.status());
    forget_token();
    return settled.status();
  }
  std::vector<transport::LocalRegion> exports;
  if (!options.exports.empty()) {
    auto exported = regions_.ExportTo(id, options.exports);
    if (!exported.ok()) {
      accepted->connection->Close(exported.status());
      forget_token();
      return exported.status();
    }
    exports = std::move(*exported);
  }
  std::shared_ptr<Peer> peer = AddPeer(id, address, std::move(*accepted), *settled);
  (void)SendExports(*peer, exports);
  // Channel setup runs on the worker, like every other change to a peer's data path.
  auto done = std::make_shared<std::pair<Mutex, std::optional<absl::Status>>>();
  auto cv = std::make_shared<CondVar>();
  worker_->Post([this, peer, done, cv] {
    absl::Status s = SetupChannels(peer);
    MutexLock lock(&done->first);
    done->second = s;
    cv->SignalAll();
  });
  absl::Status setup = absl::DeadlineExceededError(
      absl::StrCat("connect to ", address, ": data path not ready within ",
                   absl::FormatDuration(options_.connect_timeout)));
  {
    const absl::Time deadline = absl::Now() + options_.connect_timeout + absl::Seconds(1);
    MutexLock lock(&done->first);
    while (!done->second.has_value() && absl::Now() < deadline) {
      cv->WaitUntil(&done->first, deadline);
    }
    if (done->second.has_value()) setup = *done->second;
  }
  if (!setup.ok()) {
    ClosePeer(peer, setup);
    return setup;
  }
  return id;
}

std::string Engine::Impl::ForcedName(TransportKind preference) {
  return preference == TransportKind::kAuto ? std::string() : TransportKindName(preference);
}

transport::ControlSender Engine::Impl::ControlSenderFor(
    size_t index, std::shared_ptr<control::Connection> conn) const {
  return [name = caps_[index]->name, conn = std::move(conn)](std::string payload) {
    pb::Envelope message;
    pb::TransportControl* control = message.mutable_transport_control();
    control->set_transport(name);
    control->set_payload(std::move(payload));
    return conn->Send(message);
  };
}

absl::StatusOr<std::unique_ptr<transport::Channel>> Engine::Impl::ConnectChannel(
    const std::shared_ptr<Peer>& peer, size_t index, transport::PeerLink link) {
  transport::Transport& t = *transports_[index];
  const transport::Capabilities& caps = t.caps();
  const pb::TransportEndpoint* ep = FindEndpoint(peer->hello, caps.name);
  if (ep == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("peer offers no ", caps.name, " endpoint"));
  }
  if (absl::Status s = t.CanReach(ep->endpoint()); !s.ok()) return s;
  link.remote_endpoint = ep->endpoint();
  link.lanes = std::clamp<uint32_t>(caps.lanes_per_peer, 1, std::max<uint32_t>(1, caps.max_lanes));
  link.send_control = ControlSenderFor(index, peer->conn);
  return t.Connect(link);
}

absl::Status Engine::Impl::SetupChannels(const std::shared_ptr<Peer>& peer) {
  transport::PeerLink link;
  link.peer = peer->id;
  link.peer_name = peer->name;
  link.token = peer->hello.session_token();
  link.remote_pid = peer->hello.pid();
  link.deadline = absl::Now() + options_.connect_timeout;

  // Which transports to open, from their declarations (src/core/route.h).
  core::ChannelChoice choice(caps_, ForcedName(peer->preference));
  std::vector<std::shared_ptr<transport::Channel>> channels(transports_.size());
  std::vector<uint32_t> lanes(transports_.size(), 1);
  std::vector<std::string> described(transports_.size());
  while (std::optional<size_t> next = choice.Next()) {
    const size_t i = *next;
    auto channel = ConnectChannel(peer, i, link);
    if (!channel.ok()) {
      choice.Unusable(i, std::string(channel.status().message()));
      continue;
    }
    channels[i] = std::move(*channel);
    lanes[i] = std::clamp<uint32_t>(caps_[i]->lanes_per_peer, 1,
                                    std::max<uint32_t>(1, caps_[i]->max_lanes));
    described[i] = channels[i]->Describe();
    choice.Connected(i);
  }
  auto close_all = [&](const absl::Status& why) {
    for (auto& channel : channels) {
      if (channel) channel->Close(why);
    }
  };
  if (absl::Status s = choice.Result(peer->name); !s.ok()) {
    close_all(absl::CancelledError("data path to the peer not usable"));
    return s;
  }
  const std::string desc = choice.Describe(described);
  const std::string reason = choice.Reason();
  {
    MutexLock lock(&peer->mu);
    if (!peer->alive) {
      close_all(absl::CancelledError("peer closed during setup"));
      return absl::UnavailableError(
          absl::StrCat("peer ", peer->name, " closed during setup: ", peer->close_reason));
    }
    peer->channels = std::move(channels);
    peer->lanes = std::move(lanes);
    if (std::optional<size_t> g = choice.GrantFallback()) {
      peer->guarded_only = core::TransportMask{1} << *g;
    }
    peer->transport_desc = desc;
    peer->transport_reason = reason;
  }
  KVW_LOG(kInfo, "engine") << "data path ready" << Kv("engine", name_) << Kv("peer", peer->name)
                           << Kv("transport", desc) << Kv("reason", reason);
  ResolveRemoteRegions(peer);
  {
    MutexLock lock(&peer->mu);
    peer->setup_done = true;
  }
  {
    MutexLock lock(&peers_mu_);
    peers_cv_.SignalAll();
  }
  return absl::OkStatus();
}

// Decides, for each region the peer exported that has no route yet, which of the peer's
// channels reach it: those of transports that need a per-region key accept it or not
// (AddRemoteRegions); the others reach every region. Runs on the worker (channel changes are
// serialized there).
void Engine::Impl::ResolveRemoteRegions(const std::shared_ptr<Peer>& peer) {
  std::vector<transport::RemoteRegionDesc> todo;
  std::vector<std::map<std::string, std::string>> keys;  // by todo index
  std::vector<std::shared_ptr<transport::Channel>> channels;
  {
    MutexLock lock(&peer->mu);
    if (!peer->alive || peer->channels.empty()) return;
    channels = peer->channels;
    for (auto& [id, state] : peer->remote) {
      if (state.resolved) continue;
      todo.push_back(state.desc);
      keys.push_back(state.transport_keys);
    }
  }
  std::vector<std::pair<RegionId, core::TransportMask>> routes;
  for (size_t r = 0; r < todo.size(); ++r) {
    const transport::RemoteRegionDesc& desc = todo[r];
    core::TransportMask reached = 0;
    for (size_t i = 0; i < channels.size(); ++i) {
      if (!channels[i] || caps_[i]->reaches_every_region) continue;
      const std::string& name = caps_[i]->name;
      auto key = keys[r].find(name);
      transport::RemoteRegionDesc keyed = desc;
      absl::Status s = keyed.SetKey(key == keys[r].end() ? std::string() : key->second)
                           ? channels[i]->AddRemoteRegions({keyed})
                           : absl::InvalidArgumentError(absl::StrCat(name, " key too long"));
      if (s.ok()) {
        reached |= core::TransportMask{1} << i;
      } else {
        KVW_LOG(kInfo, "engine") << "region not reachable over " << name << Kv("engine", name_)
                                 << Kv("peer", peer->name) << Kv("region", desc.id)
                                 << Kv("reason", s.message());
      }
    }
    routes.emplace_back(desc.id, reached);
  }
  {
    MutexLock lock(&peer->mu);
    for (auto [id, reached] : routes) {
      auto it = peer->remote.find(id);
      if (it == peer->remote.end()) continue;  // revoked meanwhile
      it->second.resolved = true;
      it->second.reached_by = reached;
    }
  }
  MutexLock lock(&peers_mu_);
  peers_cv_.SignalAll();
}

void Engine::Impl::OnTransportControl(const std::shared_ptr<Peer>& peer,
                                      const pb::TransportControl& message) {
  for (size_t i = 0; i < transports_.size(); ++i) {
    if (caps_[i]->name != message.transport()) continue;
    transports_[i]->OnControlMessage(peer->id, message.payload(), ControlSenderFor(i, peer->conn));
    return;
  }
  // This engine offered no such endpoint, so a correct peer never sends it.
  ClosePeerForProtocol(peer, absl::InvalidArgumentError(absl::StrCat(
                                 "unexpected TransportControl from peer ", peer->name, ": engine ",
                                 name_, " offers no ", message.transport().substr(0, 64))));
}

void Engine::Impl::OnMessage(const std::shared_ptr<Peer>& peer, const pb::Envelope& message) {
  switch (message.body_case()) {
    case pb::Envelope::kExportRegions: {
      for (const pb::RegionDescriptor& d : message.export_regions().regions()) {
        if (d.memory_kind() > static_cast<uint32_t>(MemoryKind::kGpu)) {
          ClosePeerForProtocol(
              peer, absl::InvalidArgumentError(absl::StrCat(
                        "malformed ExportRegions from peer ", peer->name, ": region ", d.id(),
                        " has memory_kind ", d.memory_kind(), " (known: 0 host, 1 gpu)")));
          return;
        }
      }
      absl::Status too_many;
      {
        MutexLock lock(&peer->mu);
        if (peer->remote.size() + message.export_regions().regions_size() >
            kMaxRemoteRegionsPerPeer) {
          too_many = absl::ResourceExhaustedError(absl::StrCat(
              "peer ", peer->name, " exported ", message.export_regions().regions_size(),
              " more regions on top of ", peer->remote.size(), " (limit ", kMaxRemoteRegionsPerPeer,
              " per peer)"));
        }
        for (const pb::RegionDescriptor& d : message.export_regions().regions()) {
          if (!too_many.ok()) break;
          RemoteRegionState state;
          state.desc.id = d.id();
          state.desc.length = d.length();
          state.desc.access = d.access();
          state.desc.kind = static_cast<MemoryKind>(d.memory_kind());
          state.desc.address = d.address();
          state.desc.reads_need_grant = d.reads_need_grant();
          state.transport_keys.insert(d.transport_keys().begin(), d.transport_keys().end());
          peer->remote[d.id()] = state;
        }
      }
      if (!too_many.ok()) {
        ClosePeerForProtocol(peer, too_many);
        return;
      }
      worker_->Post([this, peer] {
        bool ready;
        {
          MutexLock lock(&peer->mu);
          ready = peer->setup_done;
        }
        // Before setup, SetupChannels resolves everything known by then.
        if (ready) ResolveRemoteRegions(peer);
      });
      break;
    }
    case pb::Envelope::kRevokeRegions: {
      std::vector<RegionId> ids(message.revoke_regions().ids().begin(),
                                message.revoke_regions().ids().end());
      std::vector<std::shared_ptr<transport::Channel>> channels;
      {
        MutexLock lock(&peer->mu);
        for (RegionId id : ids) peer->remote.erase(id);
        channels = peer->channels;
      }
      for (auto& channel : channels) {
        if (channel) worker_->Post([channel, ids] { channel->RemoveRemoteRegions(ids); });
      }
      break;
    }
    case pb::Envelope::kNotify: {
      Notification n;
      n.peer = peer->id;
      n.peer_name = peer->name;
      n.transfer_id = message.notify().transfer_id();
      n.payload = message.notify().payload();
      if (absl::Status s = arrivals_.OnNotify(std::move(n), message.notify().expected_arrivals());
          !s.ok()) {
        ClosePeerForProtocol(
            peer, absl::Status(s.code(), absl::StrCat("peer ", peer->name, ": ", s.message())));
        return;
      }
      break;
    }
    case pb::Envelope::kEngineMessage:
      OnEngineMessage(peer, message.engine_message());
      break;
    case pb::Envelope::kTransportControl:
      OnTransportControl(peer, message.transport_control());
      break;
    default:
      ClosePeerForProtocol(
          peer, absl::InvalidArgumentError(absl::StrCat(
                    "unexpected control message ", control::MessageName(message), " (field ",
                    static_cast<int>(message.body_case()), ") from peer ", peer->name)));
      return;
  }
}

void Engine::Impl::ClosePeerForProtocol(const std::shared_ptr<Peer>& peer,
                                        const absl::Status& reason) {
  peers_closed_for_protocol_.fetch_add(1);
  KVW_LOG(kWarning, "engine") << "closing peer for a protocol error" << Kv("engine", name_)
                              << Kv("peer", peer->name) << Kv("error", reason.message());
  // Teardown joins transport threads: never on the I/O thread that read the message.
  worker_->Post([this, peer, reason] { ClosePeer(peer, reason); });
}

void Engine::Impl::ClosePeer(const std::shared_ptr<Peer>& peer, const absl::Status& reason) {
  std::vector<std::shared_ptr<transport::Channel>> channels;
  {
    MutexLock lock(&peer->mu);
    if (!peer->alive) return;
    peer->alive = false;
    peer->close_reason = std::string(reason.message());
    channels = peer->channels;
  }
  {
    // First: the peer's token stops opening data connections at once.
    MutexLock lock(&peers_mu_);
    absl::erase_if(tokens_, [&](const auto& entry) { return entry.second == peer->id; });
  }
  // An orderly close (local Disconnect or shutdown, or the peer's) is not a warning.
  const bool orderly = reason.code() == absl::StatusCode::kCancelled;
  if (LogEnabled(orderly ? LogLevel::kInfo : LogLevel::kWarning)) {
    LogLine(orderly ? LogLevel::kInfo : LogLevel::kWarning, "engine")
        << "peer closed" << Kv("engine", name_) << Kv("peer", peer->id) << Kv("name", peer->name)
        << Kv("reason", reason.ToString());
  }
  const absl::Status closed =
      absl::UnavailableError(absl::StrCat("peer ", peer->name, " closed: ", reason.message()));
  peer->conn->Close(reason);
  for (auto& channel : channels) {
    if (channel) channel->Close(closed);
  }
  for (const auto& t : transports_) t->DropPeer(peer->id);
  for (const core::TransferInfo& info : transfers_.FailIf(
           [&](const core::TransferInfo& info) { return info.peer == peer->id; },
           [&](const core::TransferInfo& info) {
             return absl::UnavailableError(absl::StrCat("transfer ", info.id, " to peer ",
                                                        peer->name, " failed: ", closed.message()));
           })) {
    RecordEnd(info, closed);
  }
  arrivals_.DropPeer(peer->id);
  regions_.ForgetPeer(peer->id);
  grants_.ForgetPeer(peer->id);
  // After its transfers failed: a consumer that sees the event finds them ended.
  messages_->PeerClosed(peer->id, peer->name, std::string(reason.message()));
  MutexLock lock(&peers_mu_);
  // Kept a while for Peers()/Stats() and their close reason, then forgotten: a stream of
  // peers that come and go must not grow the engine.
  if (peers_.contains(peer->id)) closed_peers_.push_back(peer->id);
  while (closed_peers_.size() > static_cast<size_t>(options_.closed_peers_kept)) {
    peers_.erase(closed_peers_.front());
    closed_peers_.pop_front();
  }
  peers_cv_.SignalAll();
}

absl::Status Engine::Impl::Export(PeerId id, absl::Span<const RegionId> regions) {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  auto exported = regions_.ExportTo(id, std::vector<RegionId>(regions.begin(), regions.end()));
  if (!exported.ok()) return exported.status();
  return SendExports(*peer, *exported);
}

absl::Status Engine::Impl::Unexport(PeerId id, absl::Span<const RegionId> regions) {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  const std::vector<RegionId> ids(regions.begin(), regions.end());
  if (absl::Status s = regions_.UnexportFrom(id, ids); !s.ok()) return s;
  // The keys stop working before we return; the peer learns it on the control channel (a
  // peer that ignores it just gets remote access errors).
  for (const auto& t : transports_) {
    for (RegionId r : ids) t->RevokeExport(id, r);
  }
  pb::Envelope revoke;
  for (RegionId r : ids) revoke.mutable_revoke_regions()->add_ids(r);
  (void)peer->conn->Send(revoke);
  return absl::OkStatus();
}

absl::Status Engine::Impl::Disconnect(PeerId id) {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  ClosePeer(peer, absl::CancelledError(absl::StrCat("disconnected by ", name_)));
  return absl::OkStatus();
}

absl::Status Engine::Impl::Disconnect(PeerId id, const absl::Status& reason) {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  ClosePeer(peer,
            reason.ok() ? absl::CancelledError(absl::StrCat("disconnected by ", name_)) : reason);
  return absl::OkStatus();
}

std::vector<PeerInfo> Engine::Impl::Peers() const {
  std::vector<PeerInfo> out;
  MutexLock lock(&peers_mu_);
  for (const auto& [id, peer] : peers_) {
    MutexLock peer_lock(&peer->mu);
    out.push_back(PeerInfo{id, peer->name, peer->address, peer->transport_desc, peer->alive,
                           peer->close_reason});
  }
  return out;
}

absl::StatusOr<PeerId> Engine::Impl::FindPeer(const std::string& name) const {
  MutexLock lock(&peers_mu_);
  PeerId found = 0;
  for (const auto& [id, peer] : peers_) {
    MutexLock peer_lock(&peer->mu);
    if (peer->name == name && peer->alive && peer->setup_done) found = std::max(found, id);
  }
  if (found == 0) return absl::NotFoundError(absl::StrCat("no live peer named ", name));
  return found;
}

absl::StatusOr<PeerId> Engine::Impl::WaitForPeer(const std::string& name, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    auto found = FindPeer(name);
    if (found.ok()) return found;
    MutexLock lock(&peers_mu_);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("peer ", name, " did not connect within ", absl::FormatDuration(timeout)));
    }
    peers_cv_.WaitUntil(&peers_mu_, std::min(deadline, absl::Now() + absl::Milliseconds(50)));
  }
}

absl::StatusOr<std::vector<RemoteRegion>> Engine::Impl::RemoteRegions(PeerId id) const {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  std::vector<RemoteRegion> out;
  MutexLock lock(&peer->mu);
  for (const auto& [rid, state] : peer->remote) {
    out.push_back(RemoteRegion{rid, state.desc.length, state.desc.access, state.desc.kind});
  }
  return out;
}

absl::Status Engine::Impl::WaitForRemoteRegion(PeerId id, RegionId region, absl::Duration timeout) {
  std::shared_ptr<Peer> peer = GetPeer(id);
  if (!peer) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    {
      MutexLock lock(&peer->mu);
      if (!peer->alive) {
        return absl::UnavailableError(
            absl::StrCat("peer ", peer->name, " closed: ", peer->close_reason));
      }
      auto it = peer->remote.find(region);
      if (peer->setup_done && it != peer->remote.end() && it->second.resolved) {
        return absl::OkStatus();
      }
    }
    MutexLock lock(&peers_mu_);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("peer ", peer->name,
                                                      " did not export region ", region, " within ",
                                                      absl::FormatDuration(timeout)));
    }
    peers_cv_.WaitUntil(&peers_mu_, std::min(deadline, absl::Now() + absl::Milliseconds(50)));
  }
}

}  // namespace kvwire
