// Engine::Impl, a peer's data path: which transports' channels to open (src/core/route.h),
// opening them, deciding which channel reaches each region the peer exported, and the
// transports' own control messages (TransportControl).
#include <algorithm>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/core/engine_impl.h"
#include "src/util/log.h"

namespace kvwire {

const pb::TransportEndpoint* Engine::Impl::FindEndpoint(const pb::Hello& hello,
                                                        const std::string& kind) {
  for (const pb::TransportEndpoint& t : hello.transports()) {
    if (t.kind() == kind) return &t;
  }
  return nullptr;
}

std::string Engine::Impl::ForcedName(const std::string& preference) {
  return preference == "auto" ? std::string() : preference;
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
  // Either side asking is enough: the side that wants its bytes checked gets it whatever
  // the other set (docs/CHECKSUMS.md).
  link.verify_checksums = options_.verify_checksums || peer->hello.verify_checksums();
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
  RegionsReady(peer);  // those it exported before its channels were up are usable now
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
  struct Route {
    RegionId id;
    core::TransportMask reached;
    core::TransportMask reached_by_device;
  };
  std::vector<Route> routes;
  for (size_t r = 0; r < todo.size(); ++r) {
    const transport::RemoteRegionDesc& desc = todo[r];
    core::TransportMask reached = 0;
    core::TransportMask reached_by_device = 0;
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
        if (channels[i]->MovesDeviceMemory(desc.id)) {
          reached_by_device |= core::TransportMask{1} << i;
        }
      } else {
        KVW_LOG(kInfo, "engine") << "region not reachable over " << name << Kv("engine", name_)
                                 << Kv("peer", peer->name) << Kv("region", desc.id)
                                 << Kv("reason", s.message());
      }
    }
    routes.push_back({desc.id, reached, reached_by_device});
  }
  bool usable;
  {
    MutexLock lock(&peer->mu);
    for (const Route& route : routes) {
      auto it = peer->remote.find(route.id);
      if (it == peer->remote.end()) continue;  // revoked meanwhile
      it->second.resolved = true;
      it->second.reached_by = route.reached;
      it->second.reached_by_device = route.reached_by_device;
    }
    // During SetupChannels the regions are not usable yet: it raises the event once done.
    usable = peer->setup_done && !routes.empty();
  }
  if (usable) {
    RegionsReady(peer);
  } else {
    MutexLock lock(&peers_mu_);  // never under peer->mu (Peers() takes them the other way)
    PeersChangedLocked();
  }
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

}  // namespace kvwire
