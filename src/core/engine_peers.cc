// Engine::Impl, a live peer: the control messages it sends (dispatched to the files of each
// job), closing it (for a protocol error, on request, or when it dies), and finding peers.
// The handshake is engine_handshake.cc, exports engine_exports.cc, channels engine_channels.cc.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/control/handshake.h"
#include "src/core/engine_impl.h"
#include "src/util/log.h"

namespace kvwire {

std::shared_ptr<Peer> Engine::Impl::GetPeer(PeerId id) const {
  MutexLock lock(&peers_mu_);
  auto it = peers_.find(id);
  return it == peers_.end() ? nullptr : it->second;
}

void Engine::Impl::OnMessage(const std::shared_ptr<Peer>& peer, const pb::Envelope& message) {
  switch (message.body_case()) {
    case pb::Envelope::kExportRegions:
      OnExportRegions(peer, message.export_regions());
      break;
    case pb::Envelope::kRevokeRegions:
      OnRevokeRegions(peer, message.revoke_regions());
      break;
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
    // Taken, not copied: a closed peer stays in peers_ a while (closed_peers_kept, for Peers()
    // and its close reason) and must not hold its channels' descriptors and mappings meanwhile
    // (a shm channel keeps its socket and the peer's epoch table until destroyed). How many
    // of the kept peers still held channels depended on how far each got before it closed,
    // so the counts of a connect/disconnect loop drifted by a channel or two under load.
    // Whoever still uses a channel (a Post in flight, a queued region change) holds it.
    channels = std::move(peer->channels);
    peer->channels.clear();
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
  served_ops_->ForgetPeer(peer->id, grants_);  // its grants, and their watches stop waiting
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
  PeersChangedLocked();
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
    uint64_t seen;
    {
      MutexLock lock(&peers_mu_);
      seen = peers_epoch_;
    }
    auto found = FindPeer(name);
    if (found.ok()) return found;
    // A peer's setup ends with PeersChangedLocked: sleeping until the epoch moves misses none.
    MutexLock lock(&peers_mu_);
    while (peers_epoch_ == seen) {
      if (!peers_cv_.WaitUntil(&peers_mu_, deadline) && peers_epoch_ == seen) {
        return absl::DeadlineExceededError(
            absl::StrCat("peer ", name, " did not connect within ", absl::FormatDuration(timeout)));
      }
    }
  }
}

}  // namespace kvwire
