#include "transport/rdma/rdma_transport.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "src/util/log.h"
#include "transport/rdma/rdma.pb.h"
#include "transport/rdma/rdma_address.h"
#include "transport/rdma/rdma_device.h"
#include "transport/rdma/rdma_transport_impl.h"

// RdmaTransportImpl: lifetime, reachability, peers and stats; CreateRdmaTransport.

namespace kvwire::transport {
namespace rdma {

RdmaTransportImpl::RdmaTransportImpl(const RdmaTransportOptions& options, TargetHooks* hooks,
                                     std::vector<std::shared_ptr<DevicePort>> devices)
    : options_(options), hooks_(hooks), devices_(std::move(devices)) {
  caps_.name = "rdma";
  caps_.rank = 20;  // NIC, zero copy: below shm on one host, above kernel tcp
  caps_.counts_arrivals = true;
  caps_.gpu_memory = options_.gpu_runtime != nullptr;
  caps_.max_op_bytes = options_.max_op_bytes;
  for (const auto& d : devices_) {
    caps_.max_op_bytes = std::min<uint64_t>(caps_.max_op_bytes, d->port_attr.max_msg_sz);
  }
  caps_.max_lanes = static_cast<uint32_t>(devices_.size()) * std::max(1u, options_.qps_per_device);
  caps_.lanes_per_peer = caps_.max_lanes;  // every QP of every device
  for (const auto& d : devices_) {
    loops_.push_back(std::make_unique<DeviceLoop>(d, hooks_, &counters_));
  }
}

absl::Status RdmaTransportImpl::Start() {
  pb::RdmaEndpoint ep;
  std::vector<std::string> names;
  for (const auto& d : devices_) {
    *ep.add_devices() = d->ToProto();
    names.push_back(absl::StrCat(d->Describe(), d->ethernet ? " gid[" : " lid ",
                                 d->ethernet ? absl::StrCat(d->gid_index, "]=", GidToString(d->gid))
                                             : absl::StrCat(d->port_attr.lid),
                                 " mtu ", MtuName(d->port_attr.active_mtu)));
  }
  endpoint_ = ep.SerializeAsString();
  summary_ = absl::StrJoin(names, ", ");
  KVW_LOG(kInfo, "rdma") << "transport ready" << Kv("devices", summary_)
                         << Kv("qps_per_device", options_.qps_per_device);
  return absl::OkStatus();
}

absl::Status RdmaTransportImpl::CanReach(const std::string& remote_endpoint) const {
  pb::RdmaEndpoint remote;
  if (!remote.ParseFromString(remote_endpoint) || remote.devices_size() == 0) {
    return absl::InvalidArgumentError("peer's rdma endpoint is malformed or lists no device");
  }
  for (const auto& d : devices_) {
    for (const pb::RdmaDevice& r : remote.devices()) {
      if (r.ethernet() == d->ethernet) return absl::OkStatus();
    }
  }
  return absl::FailedPreconditionError(
      "no local device shares a link layer (RoCE / InfiniBand) with the peer's");
}

void RdmaTransportImpl::DropPeer(PeerId peer) {
  {
    MutexLock lock(&calls_mu_);
    closed_peers_.erase(peer);
  }
  std::vector<std::shared_ptr<ServerQp>> dropped;
  {
    MutexLock lock(&server_mu_);
    for (auto it = targets_.begin(); it != targets_.end();) {
      if (it->first.first != peer) {
        ++it;
        continue;
      }
      for (auto& [index, qp] : it->second) dropped.push_back(qp);
      it = targets_.erase(it);
    }
  }
  for (auto& qp : dropped) {
    for (auto& loop : loops_) loop->Remove(qp->qpn());
  }
  // Its MRs are deregistered here; its PDs go with the last of its QPs.
  PeerGrants<PeerDomain, std::shared_ptr<PeerMr>>::Dropped grants;
  {
    MutexLock lock(&grants_mu_);
    grants = grants_.DropPeer(peer);
  }
  if (!dropped.empty() || !grants.grants.empty()) {
    KVW_LOG(kInfo, "rdma") << "target QPs and exports of peer torn down" << Kv("peer", peer)
                           << Kv("qps", dropped.size()) << Kv("regions", grants.grants.size());
  }
}

void RdmaTransportImpl::AddStats(std::vector<TransportStat>* stats) const {
  const auto add = [&](const char* name, const std::atomic<uint64_t>& counter) {
    AddStat(stats, "rdma", name, counter.load(std::memory_order_relaxed));
  };
  add("work_requests", counters_.wrs);
  add("post_calls", counters_.post_calls);
  add("signalled", counters_.signalled);
  add("inline_wrs", counters_.inline_wrs);
  add("queued_wrs", counters_.queued_wrs);
  add("completion_errors", counters_.completion_errors);
  add("async_events", counters_.async_events);
  add("qp_reconnects", counters_.qp_reconnects);
  MutexLock lock(&mrs_mu_);
  AddStat(stats, "gpu", "rdma_dmabuf_regions", gpu_dmabuf_regions_);
  AddStat(stats, "gpu", "rdma_peermem_regions", gpu_peermem_regions_);
  SetStatText(stats, "gpu", "rdma_path_reason", gpu_path_reason_);
}

void RdmaTransportImpl::Shutdown() {
  {
    MutexLock lock(&calls_mu_);
    if (shut_down_.exchange(true)) return;
  }
  AbortCalls(nullptr, absl::UnavailableError("rdma transport shut down"));
  runner_->Stop();
  {
    MutexLock lock(&server_mu_);
    targets_.clear();
  }
  {
    MutexLock lock(&grants_mu_);
    (void)grants_.Clear();
  }
  for (auto& loop : loops_) loop->Stop();
  KVW_LOG(kInfo, "rdma") << "transport stopped" << Kv("post_calls", counters_.post_calls.load())
                         << Kv("wrs", counters_.wrs.load())
                         << Kv("signalled", counters_.signalled.load())
                         << Kv("pieces", counters_.pieces.load());
}

}  // namespace rdma

std::vector<TransportStat> RdmaTransportStats() {
  using Kind = TransportStat::Kind;
  const auto rdma = [](const char* name, const char* metric, const char* help) {
    return DeclareStat("rdma", "rdma", name, Kind::kCounter, metric, help);
  };
  return {
      // The posting path. Chains: one ibv_post_send each.
      rdma("work_requests", "rdma_work_requests_total", "rdma work requests posted."),
      rdma("post_calls", "rdma_post_calls_total", "ibv_post_send calls (one per chain)."),
      rdma("signalled", "rdma_signalled_total", "rdma work requests posted signalled."),
      rdma("inline_wrs", "rdma_inline_total", "rdma work requests with inline payload."),
      rdma("queued_wrs", "rdma_queued_total",
           "rdma work requests that waited for send-queue room."),
      rdma("completion_errors", "rdma_completion_errors_total",
           "rdma work completions with an error status."),
      rdma("async_events", "rdma_async_events_total", "rdma error events (QP, CQ, port, device)."),
      rdma("qp_reconnects", "rdma_qp_reconnects_total", "rdma QPs re-created after a failure."),
      // GPU regions registered now, by path, and why the newest took its path.
      DeclareStat("rdma", "gpu", "rdma_dmabuf_regions", Kind::kCounter,
                  "gpu_rdma_dmabuf_regions_total",
                  "GPU regions registered with ibv_reg_dmabuf_mr."),
      DeclareStat("rdma", "gpu", "rdma_peermem_regions", Kind::kCounter,
                  "gpu_rdma_peermem_regions_total",
                  "GPU regions registered with ibv_reg_mr on the device pointer (peer memory)."),
      DeclareStat("rdma", "gpu", "rdma_path_reason", Kind::kText),
  };
}

absl::StatusOr<std::unique_ptr<Transport>> CreateRdmaTransport(const RdmaTransportOptions& options,
                                                               TargetHooks* hooks) {
  std::vector<std::string> skipped;
  auto devices = rdma::OpenDevices(options, &skipped);
  for (const std::string& line : skipped) {
    KVW_LOG(kInfo, "rdma") << "device skipped" << Kv("reason", line);
  }
  if (!devices.ok()) return devices.status();
  auto transport = std::make_unique<rdma::RdmaTransportImpl>(options, hooks, std::move(*devices));
  if (absl::Status s = transport->Start(); !s.ok()) return s;
  return transport;
}

}  // namespace kvwire::transport
