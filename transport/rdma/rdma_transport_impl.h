// The rdma Transport (design: rdma_transport.h). Its methods live by job: rdma_transport.cc
// (lifetime, reachability, peers, stats), rdma_regions.cc (registration and exports to
// peers), rdma_qp_exchange.cc (channel set-up: the QP exchange on the control channel).
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_TRANSPORT_IMPL_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_TRANSPORT_IMPL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"
#include "src/util/task_runner.h"
#include "transport/rdma/rdma.pb.h"
#include "transport/rdma/rdma_client_qp.h"
#include "transport/rdma/rdma_device.h"
#include "transport/rdma/rdma_device_loop.h"
#include "transport/rdma/rdma_grants.h"
#include "transport/rdma/rdma_post_counters.h"
#include "transport/rdma/rdma_regions.h"
#include "transport/rdma/rdma_server_qp.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/transport.h"

namespace kvwire::transport::rdma {

class RdmaTransportImpl final : public Transport {
 public:
  RdmaTransportImpl(const RdmaTransportOptions& options, TargetHooks* hooks,
                    std::vector<std::shared_ptr<DevicePort>> devices);
  ~RdmaTransportImpl() override { Shutdown(); }

  // Builds the endpoint (the devices' addresses) and logs the devices.
  absl::Status Start();

  const Capabilities& caps() const override { return caps_; }
  std::string Endpoint() const override { return endpoint_; }
  absl::Status RegisterRegion(const LocalRegion& region) override;
  void DeregisterRegion(RegionId id) override;
  absl::StatusOr<std::string> ExportKey(PeerId peer, RegionId id) override;
  void RevokeExport(PeerId peer, RegionId id) override;
  absl::Status CanReach(const std::string& remote_endpoint) const override;
  absl::StatusOr<std::unique_ptr<Channel>> Connect(const PeerLink& link) override;
  void DropPeer(PeerId peer) override;
  void AbortPending(PeerId peer, const absl::Status& reason) override;
  void Shutdown() override;
  void OnControlMessage(PeerId peer, const std::string& payload,
                        const ControlSender& reply) override;
  void AddStats(std::vector<TransportStat>* stats) const override;

  // Fails the QP exchanges and checksum checks in flight for `core` (its channel closed).
  void AbortCalls(const ChannelCore* core, const absl::Status& status);
  // End-to-end checksums (PeerLink::verify_checksums; rdma_checksums.cc): a lane's ops have
  // completed; asks the target for the CRC32C of its side of each and compares with this
  // side's. `done` runs exactly once: OK, DataLoss on a mismatch, or the reason it could not
  // be checked (the channel closed).
  void VerifyLane(const ChannelCore& core, TransferId transfer_id, OpKind kind, WireOps ops,
                  DoneCallback done);
  // Creates the target ends for `qps` and brings them up; deadline-bound, blocking.
  absl::Status Establish(const ChannelCore& core, const std::vector<std::shared_ptr<ClientQp>>& qps,
                         absl::Time deadline);
  void ScheduleReconnect(std::shared_ptr<ClientQp> qp);
  // lkey of local region `region` on `device` for [addr, addr+length), which must lie inside
  // it; NotFound when the region is not registered here.
  absl::StatusOr<uint32_t> LocalKey(RegionId region, uint64_t addr, uint64_t length,
                                    uint32_t device) const;
  uint32_t DeviceIndex(const DevicePort* dev) const {
    for (size_t i = 0; i < devices_.size(); ++i)
      if (devices_[i].get() == dev) return static_cast<uint32_t>(i);
    return 0;
  }
  DeviceLoop* loop(uint32_t device) { return loops_[device].get(); }
  size_t devices() const { return devices_.size(); }
  const RdmaTransportOptions& options() const { return options_; }
  PostCounters* counters() { return &counters_; }
  const std::string& summary() const { return summary_; }

 private:
  // One QP exchange in flight: the request went out on the control channel, the reply (or
  // an abort) fills `reply` / `status`.
  struct PendingCall {
    PeerId peer = 0;
    const ChannelCore* core = nullptr;
    bool done = false;
    absl::Status status;
    pb::RdmaConnectReply reply;
  };
  // Sends `request` on core's control channel and waits for the reply until `deadline`.
  absl::StatusOr<pb::RdmaConnectReply> Exchange(const ChannelCore& core,
                                                pb::RdmaConnectRequest request,
                                                absl::Time deadline);
  // Target side: creates the QP ends a peer asks for.
  pb::RdmaConnectReply HandleConnect(PeerId peer, const pb::RdmaConnectRequest& request);
  // One lane's checksum request on the wire; its reply completes it.
  struct PendingCheck {
    PeerId peer = 0;
    const ChannelCore* core = nullptr;
    std::string peer_name;
    TransferId transfer_id = 0;
    OpKind kind = OpKind::kRead;
    WireOps ops;
    std::vector<uint32_t> local;  // this side's CRC per op
    DoneCallback done;
  };
  // Target side: the CRC32C of each range of a checksum request.
  pb::RdmaChecksumReply HandleChecksum(PeerId peer, const pb::RdmaChecksumRequest& request);
  // Initiator side: compares and completes the pending check.
  void OnChecksumReply(PeerId peer, const pb::RdmaChecksumReply& reply);
  // A kGpu region's MRs on every device (rdma_gpu_mr.h); `reason` gets the path per device.
  absl::Status RegisterGpuRegion(const LocalRegion& region, int access, LocalMr& mr,
                                 std::string* reason);
  // The peer's PDs, made on first use (an export to it or its first QPs).
  absl::StatusOr<PeerDomain> DomainOf(PeerId peer);
  // Registers `region` in `domain`'s PDs, the way its own MRs were registered.
  absl::Status RegisterFor(const LocalMr& region, PeerMr& out);

  const RdmaTransportOptions options_;
  TargetHooks* const hooks_;
  const std::vector<std::shared_ptr<DevicePort>> devices_;
  Capabilities caps_;
  std::string endpoint_;
  std::string summary_;
  std::vector<std::unique_ptr<DeviceLoop>> loops_;
  PostCounters counters_;
  std::atomic<bool> shut_down_{false};

  mutable Mutex mrs_mu_;
  absl::flat_hash_map<RegionId, std::shared_ptr<LocalMr>> mrs_ ABSL_GUARDED_BY(mrs_mu_);
  // GpuStats: GPU regions registered now, by path, and why the newest took its path.
  uint64_t gpu_dmabuf_regions_ ABSL_GUARDED_BY(mrs_mu_) = 0;
  uint64_t gpu_peermem_regions_ ABSL_GUARDED_BY(mrs_mu_) = 0;
  std::string gpu_path_reason_ ABSL_GUARDED_BY(mrs_mu_);

  // The regions exported to each peer, registered in that peer's PDs.
  Mutex grants_mu_;
  PeerGrants<PeerDomain, std::shared_ptr<PeerMr>> grants_ ABSL_GUARDED_BY(grants_mu_);

  Mutex server_mu_;
  // (peer, channel id) -> target QPs by index.
  std::map<std::pair<PeerId, uint64_t>, std::map<uint32_t, std::shared_ptr<ServerQp>>> targets_
      ABSL_GUARDED_BY(server_mu_);

  Mutex calls_mu_;
  CondVar calls_cv_;
  uint64_t next_call_ ABSL_GUARDED_BY(calls_mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<PendingCall>> calls_ ABSL_GUARDED_BY(calls_mu_);
  absl::flat_hash_map<uint64_t, PendingCheck> checks_ ABSL_GUARDED_BY(calls_mu_);
  // Peers whose control connection closed (AbortPending) and that DropPeer has not dropped
  // yet: an exchange that starts meanwhile fails at once with the reason.
  absl::flat_hash_map<PeerId, absl::Status> closed_peers_ ABSL_GUARDED_BY(calls_mu_);

  std::unique_ptr<TaskRunner> runner_ = std::make_unique<TaskRunner>();  // QP re-creation
};

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_TRANSPORT_IMPL_H_
