// The target end of one rdma QP: its slot table and receive queue, in the peer's PD.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_SERVER_QP_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_SERVER_QP_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

#include "transport/rdma/rdma.pb.h"
#include "transport/rdma/rdma_device.h"
#include "transport/rdma/rdma_plan.h"
#include "transport/rdma/rdma_regions.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/verbs.h"
#include "transport/transport.h"

namespace kvwire::transport::rdma {

// The target end of one QP: receives the immediates of counted WRITE lanes.
class ServerQp {
 public:
  // `pd`: the peer's PD on `dev`; its QP and slot table are reachable from that peer only.
  ServerQp(std::shared_ptr<DevicePort> dev, std::shared_ptr<PeerPd> pd, PeerId peer,
           uint64_t channel, uint32_t index)
      : dev_(std::move(dev)),
        pd_(std::move(pd)),
        peer_(peer),
        channel_(channel),
        index_(index),
        table_(kSlotsPerQp + 8, 0) {}
  ~ServerQp() {
    qp_.reset();
    table_mr_.reset();
    if (reserved_ != 0) dev_->ReleaseCq(reserved_);
    if (holds_qp_) dev_->ReleaseQp();
  }

  // Creates the QP and its slot table in the peer's PD and brings it to RTS against the
  // initiator's `remote`; returns what the initiator needs.
  absl::StatusOr<pb::RdmaQpInfo> Create(const pb::RdmaQpInfo& remote,
                                        const pb::RdmaDevice& remote_dev,
                                        const RdmaTransportOptions& o);

  absl::Status PostRecv();

  // Event thread only.
  void OnCompletion(const ibv_wc& wc, TargetHooks* hooks);

  uint32_t qpn() const { return qp_ ? qp_->qp_num : 0; }
  PeerId peer() const { return peer_; }

 private:
  std::shared_ptr<DevicePort> dev_;
  std::shared_ptr<PeerPd> pd_;  // outlives table_mr_ and qp_
  PeerId peer_;
  uint64_t channel_;
  uint32_t index_;
  std::vector<uint64_t> table_;  // kSlotsPerQp transfer ids, then the receive scratch
  Mr table_mr_;
  Qp qp_;
  uint32_t reserved_ = 0;  // CQ entries
  bool holds_qp_ = false;  // one QP of the device's budget
};

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_SERVER_QP_H_
