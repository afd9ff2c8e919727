// The initiator end of one rdma RC QP: it posts the lanes queued on it within its send
// window, completes them from its completions, and is re-created after it breaks.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_CLIENT_QP_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_CLIENT_QP_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "src/util/mutex.h"
#include "transport/rdma/rdma.pb.h"
#include "transport/rdma/rdma_device.h"
#include "transport/rdma/rdma_device_loop.h"
#include "transport/rdma/rdma_plan.h"
#include "transport/rdma/rdma_post_counters.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/verbs.h"
#include "transport/transport.h"

namespace kvwire::transport::rdma {

class RdmaTransportImpl;

// What every QP of a channel needs to re-create itself.
struct ChannelCore {
  RdmaTransportImpl* transport = nullptr;
  PeerId peer = 0;
  std::string peer_name;
  ControlSender send;  // the engine's control channel to the peer
  uint64_t channel_id = 0;
  pb::RdmaEndpoint remote;
  bool verify_checksums = false;  // PeerLink::verify_checksums (rdma_checksums.cc)
};

struct Lane {
  PostRequest request;
  DoneCallback done;
  WrPlan plan;
  ibv_wr_opcode opcode = IBV_WR_RDMA_WRITE;
  bool counted = false;
  // Some local piece is device memory: never inline (the CPU would read the payload).
  bool local_gpu = false;
  uint32_t pieces = 0;
  size_t next_wr = 0;
  std::optional<uint32_t> slot;
  uint64_t last_seq = 0;
};

struct Finished {
  DoneCallback done;
  absl::Status status;
};

// The initiator end of one RC QP of a channel.
class ClientQp : public std::enable_shared_from_this<ClientQp> {
 public:
  enum class State { kConnecting, kReady, kBroken, kClosed };

  ClientQp(std::shared_ptr<ChannelCore> core, DeviceLoop* loop, uint32_t index,
           uint32_t remote_device, const RdmaTransportOptions& options, PostCounters* counters)
      : core_(std::move(core)),
        loop_(loop),
        dev_(loop->device()),
        index_(index),
        remote_device_(remote_device),
        options_(options),
        counters_(counters),
        window_(1),
        bind_src_(kSlotsPerQp, 0) {}
  ~ClientQp() {
    MutexLock lock(&mu_);
    DestroyLocked();
  }

  uint32_t index() const { return index_; }
  uint32_t remote_device() const { return remote_device_; }
  const ChannelCore& core() const { return *core_; }
  const std::shared_ptr<DevicePort>& device() const { return dev_; }

  // Creates a fresh ibv QP in INIT; returns what the target needs.
  absl::StatusOr<pb::RdmaQpInfo> Prepare() ABSL_LOCKS_EXCLUDED(mu_);
  // Brings the QP to RTS against the target's answer and starts posting.
  absl::Status Finish(const pb::RdmaQpInfo& remote) ABSL_LOCKS_EXCLUDED(mu_);
  // A (re-)connection attempt failed: fail what waits and stay broken.
  void SetupFailed(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  void Enqueue(std::unique_ptr<Lane> lane) ABSL_LOCKS_EXCLUDED(mu_);
  void OnCompletion(const ibv_wc& wc) ABSL_LOCKS_EXCLUDED(mu_);
  // Async event or transport error: fail every lane, re-create on next use.
  void Break(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  void Close(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t qpn() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return qp_ ? qp_->qp_num : 0;
  }

 private:
  void PumpLocked(std::vector<Finished>* finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BreakLocked(const absl::Status& status, const Lane* culprit, std::vector<Finished>* finished)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLaneLocked(std::unique_ptr<Lane> lane, absl::Status status,
                        std::vector<Finished>* finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DestroyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ScheduleReconnectLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<ChannelCore> core_;
  DeviceLoop* const loop_;
  const std::shared_ptr<DevicePort> dev_;
  const uint32_t index_;
  const uint32_t remote_device_;
  const RdmaTransportOptions options_;
  PostCounters* const counters_;

  Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kConnecting;
  bool reconnecting_ ABSL_GUARDED_BY(mu_) = false;
  Qp qp_ ABSL_GUARDED_BY(mu_);
  uint32_t reserved_ ABSL_GUARDED_BY(mu_) = 0;  // CQ entries
  bool holds_qp_ ABSL_GUARDED_BY(mu_) = false;  // one QP of the device's budget
  uint32_t psn_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tag_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t max_inline_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t max_sge_ ABSL_GUARDED_BY(mu_) = 1;
  SendWindow window_ ABSL_GUARDED_BY(mu_);
  SlotPool slots_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> bind_src_ ABSL_GUARDED_BY(mu_);  // transfer ids, by slot
  Mr bind_mr_ ABSL_GUARDED_BY(mu_);
  uint64_t remote_table_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t remote_table_rkey_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::unique_ptr<Lane>> queued_ ABSL_GUARDED_BY(mu_);  // not fully posted
  std::deque<std::unique_ptr<Lane>> posted_ ABSL_GUARDED_BY(mu_);  // fully posted
  std::vector<ibv_send_wr> scratch_ ABSL_GUARDED_BY(mu_);

 public:
  uint32_t max_sge() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return max_sge_;
  }
};

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_CLIENT_QP_H_
