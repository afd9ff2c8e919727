#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/log.h"
#include "transport/rdma/rdma_channel.h"
#include "transport/rdma/rdma_transport_impl.h"

// RdmaTransportImpl: channel set-up. Connect creates the initiator QPs and exchanges them with
// the peer over the engine's control channel; the peer's HandleConnect creates the target ends.

namespace kvwire::transport::rdma {

absl::StatusOr<std::unique_ptr<Channel>> RdmaTransportImpl::Connect(const PeerLink& link) {
  auto core = std::make_shared<ChannelCore>();
  core->transport = this;
  core->peer = link.peer;
  core->peer_name = link.peer_name;
  core->send = link.send_control;
  core->verify_checksums = link.verify_checksums;
  core->channel_id = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  if (!core->remote.ParseFromString(link.remote_endpoint) || core->remote.devices_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", link.peer_name, ": malformed rdma endpoint"));
  }
  const uint32_t ndev = static_cast<uint32_t>(devices_.size());
  // The engine asks for `lanes`; spread them over every device, at least one QP each.
  const uint32_t per_device = std::max<uint32_t>(
      1, std::min<uint32_t>(options_.qps_per_device, (link.lanes + ndev - 1) / ndev));
  std::vector<std::shared_ptr<ClientQp>> qps;
  for (uint32_t d = 0; d < ndev; ++d) {
    // Pair local device d with a remote device of the same link layer, round-robin.
    uint32_t remote_dev = d % static_cast<uint32_t>(core->remote.devices_size());
    for (int r = 0; r < core->remote.devices_size(); ++r) {
      const uint32_t candidate = (d + r) % core->remote.devices_size();
      if (core->remote.devices(candidate).ethernet() == devices_[d]->ethernet) {
        remote_dev = candidate;
        break;
      }
    }
    for (uint32_t q = 0; q < per_device; ++q) {
      qps.push_back(std::make_shared<ClientQp>(core, loops_[d].get(), d * per_device + q,
                                               remote_dev, options_, &counters_));
    }
  }
  if (absl::Status s = Establish(*core, qps, link.deadline); !s.ok()) {
    for (auto& qp : qps) qp->Close(s);
    return s;
  }
  KVW_LOG(kInfo, "rdma") << "channel up" << Kv("peer", link.peer_name) << Kv("qps", qps.size())
                         << Kv("devices", ndev);
  return std::make_unique<RdmaChannel>(this, core, std::move(qps), ndev, per_device);
}

absl::Status RdmaTransportImpl::Establish(const ChannelCore& core,
                                          const std::vector<std::shared_ptr<ClientQp>>& qps,
                                          absl::Time deadline) {
  pb::RdmaConnectRequest request;
  request.set_channel_id(core.channel_id);
  for (const auto& qp : qps) {
    if (absl::Status s = qp->device()->Usable(); !s.ok()) return s;
    auto info = qp->Prepare();
    if (!info.ok()) return info.status();
    *request.add_qps() = *info;
    request.add_remote_device(qp->remote_device());
    *request.add_local_device() = qp->device()->ToProto();
  }
  auto reply = Exchange(core, std::move(request), deadline);
  if (!reply.ok()) {
    return absl::Status(reply.status().code(),
                        absl::StrCat("rdma QP exchange with peer ", core.peer_name, ": ",
                                     reply.status().message()));
  }
  if (reply->code() != 0) {
    return absl::Status(
        static_cast<absl::StatusCode>(reply->code()),
        absl::StrCat("peer ", core.peer_name, " refused rdma QPs: ", reply->error()));
  }
  if (reply->qps_size() != static_cast<int>(qps.size())) {
    return absl::InternalError(absl::StrCat("peer ", core.peer_name, " answered ",
                                            reply->qps_size(), " QPs for ", qps.size()));
  }
  for (size_t i = 0; i < qps.size(); ++i) {
    if (absl::Status s = qps[i]->Finish(reply->qps(static_cast<int>(i))); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<pb::RdmaConnectReply> RdmaTransportImpl::Exchange(const ChannelCore& core,
                                                                 pb::RdmaConnectRequest request,
                                                                 absl::Time deadline) {
  if (!core.send) return absl::FailedPreconditionError("no control channel to the peer");
  auto call = std::make_shared<PendingCall>();
  call->peer = core.peer;
  call->core = &core;
  uint64_t id = 0;
  {
    MutexLock lock(&calls_mu_);
    if (shut_down_) return absl::UnavailableError("rdma transport shut down");
    if (auto closed = closed_peers_.find(core.peer); closed != closed_peers_.end()) {
      return closed->second;
    }
    id = next_call_++;
    calls_[id] = call;
  }
  request.set_call_id(id);
  pb::RdmaControl control;
  *control.mutable_connect_request() = std::move(request);
  absl::Status sent = core.send(control.SerializeAsString());
  MutexLock lock(&calls_mu_);
  if (!sent.ok() && !call->done) {
    call->done = true;
    call->status = absl::Status(sent.code(), absl::StrCat("sending the request on the control "
                                                          "channel: ",
                                                          sent.message()));
  }
  while (!call->done && absl::Now() < deadline) calls_cv_.WaitUntil(&calls_mu_, deadline);
  calls_.erase(id);
  if (!call->done) {
    return absl::DeadlineExceededError("no reply on the control channel before the deadline");
  }
  if (!call->status.ok()) return call->status;
  return std::move(call->reply);
}

void RdmaTransportImpl::AbortCalls(const ChannelCore* core, const absl::Status& status) {
  std::vector<PendingCheck> aborted;
  {
    MutexLock lock(&calls_mu_);
    for (auto& [id, call] : calls_) {
      if ((core == nullptr || call->core == core) && !call->done) {
        call->done = true;
        call->status = status;
      }
    }
    calls_cv_.SignalAll();
    for (auto it = checks_.begin(); it != checks_.end();) {
      if (core == nullptr || it->second.core == core) {
        aborted.push_back(std::move(it->second));
        checks_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  // Outside the lock: a callback may post the next lane.
  for (PendingCheck& check : aborted) {
    check.done(absl::Status(status.code(),
                            absl::StrCat("transfer ", check.transfer_id,
                                         ": end-to-end checksum not checked: ", status.message())));
  }
}

void RdmaTransportImpl::AbortPending(PeerId peer, const absl::Status& reason) {
  // Only the QP exchanges: checksum checks end with their channel (AbortCalls), on the worker,
  // since their callbacks may post the next lane.
  const absl::Status status(
      reason.code() == absl::StatusCode::kOk ? absl::StatusCode::kUnavailable : reason.code(),
      absl::StrCat("the control connection closed: ", reason.message()));
  MutexLock lock(&calls_mu_);
  closed_peers_.try_emplace(peer, status);
  for (auto& [id, call] : calls_) {
    if (call->peer == peer && !call->done) {
      call->done = true;
      call->status = status;
    }
  }
  calls_cv_.SignalAll();
}

void RdmaTransportImpl::OnControlMessage(PeerId peer, const std::string& payload,
                                         const ControlSender& reply) {
  // The engine hands over the bytes unread: parsing (and refusing) them is this transport's.
  pb::RdmaControl message;
  if (!message.ParseFromString(payload) || message.body_case() == pb::RdmaControl::BODY_NOT_SET) {
    hooks_->OnPeerError(peer, absl::InvalidArgumentError(absl::StrCat(
                                  "malformed rdma control message (", payload.size(), " bytes)")));
    return;
  }
  if (message.has_connect_request()) {
    pb::RdmaControl answer;
    *answer.mutable_connect_reply() = HandleConnect(peer, message.connect_request());
    answer.mutable_connect_reply()->set_call_id(message.connect_request().call_id());
    if (absl::Status s = reply(answer.SerializeAsString()); !s.ok()) {
      KVW_LOG(kWarning, "rdma") << "QP exchange reply not sent" << Kv("peer", peer)
                                << Kv("error", s.message());
    }
    return;
  }
  if (message.has_checksum_request()) {
    pb::RdmaControl answer;
    *answer.mutable_checksum_reply() = HandleChecksum(peer, message.checksum_request());
    answer.mutable_checksum_reply()->set_call_id(message.checksum_request().call_id());
    if (absl::Status s = reply(answer.SerializeAsString()); !s.ok()) {
      KVW_LOG(kWarning, "rdma") << "checksum reply not sent" << Kv("peer", peer)
                                << Kv("error", s.message());
    }
    return;
  }
  if (message.has_checksum_reply()) {
    OnChecksumReply(peer, message.checksum_reply());
    return;
  }
  if (message.has_connect_reply()) {
    MutexLock lock(&calls_mu_);
    auto it = calls_.find(message.connect_reply().call_id());
    // A reply after the deadline, or from another peer, finds no call: dropped.
    if (it == calls_.end() || it->second->peer != peer || it->second->done) return;
    it->second->done = true;
    it->second->reply = message.connect_reply();
    calls_cv_.SignalAll();
  }
}

void RdmaTransportImpl::ScheduleReconnect(std::shared_ptr<ClientQp> qp) {
  counters_.qp_reconnects.fetch_add(1, std::memory_order_relaxed);
  const bool posted = runner_->Post([this, qp] {
    KVW_LOG(kInfo, "rdma") << "re-creating QP" << Kv("device", qp->device()->Describe())
                           << Kv("index", qp->index());
    // The core is shared by all QPs of the channel; re-create just this one.
    absl::Status s = Establish(qp->core(), {qp}, absl::Now() + absl::Seconds(10));
    if (!s.ok()) qp->SetupFailed(s);
  });
  if (!posted) qp->SetupFailed(absl::UnavailableError("rdma transport shut down"));
}

pb::RdmaConnectReply RdmaTransportImpl::HandleConnect(PeerId peer,
                                                      const pb::RdmaConnectRequest& request) {
  pb::RdmaConnectReply reply;
  auto refuse = [&](const absl::Status& s) {
    reply.Clear();
    reply.set_code(static_cast<uint32_t>(s.code()));
    reply.set_error(std::string(s.message()));
    return reply;
  };
  if (shut_down_) return refuse(absl::UnavailableError("rdma transport shutting down"));
  if (request.qps_size() != request.remote_device_size() ||
      request.qps_size() != request.local_device_size()) {
    return refuse(absl::InvalidArgumentError("malformed rdma connect request"));
  }
  // The peer's QPs go into its own PDs: they reach what was exported to it, nothing else.
  absl::StatusOr<PeerDomain> domain = DomainOf(peer);
  if (!domain.ok()) return refuse(domain.status());
  std::vector<std::shared_ptr<ServerQp>> created;
  for (int i = 0; i < request.qps_size(); ++i) {
    const uint32_t dev = request.remote_device(i);
    if (dev >= devices_.size()) {
      return refuse(absl::InvalidArgumentError(absl::StrCat("no local device ", dev)));
    }
    if (absl::Status s = devices_[dev]->Usable(); !s.ok()) return refuse(s);
    auto qp = std::make_shared<ServerQp>(devices_[dev], (*domain)[dev], peer, request.channel_id(),
                                         request.qps(i).index());
    auto info = qp->Create(request.qps(i), request.local_device(i), options_);
    if (!info.ok()) return refuse(info.status());
    *reply.add_qps() = *info;
    created.push_back(std::move(qp));
  }
  MutexLock lock(&server_mu_);
  auto& table = targets_[{peer, request.channel_id()}];
  for (int i = 0; i < request.qps_size(); ++i) {
    const uint32_t index = request.qps(i).index();
    DeviceLoop* loop = loops_[request.remote_device(i)].get();
    if (auto old = table.find(index); old != table.end()) loop->Remove(old->second->qpn());
    loop->AddServer(created[i]->qpn(), created[i]);
    table[index] = created[i];
  }
  return reply;
}

}  // namespace kvwire::transport::rdma
