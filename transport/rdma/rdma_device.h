// Discovery and per-device state of the rdma transport: the opened device, its PD, its CQ
// with completion channel, and the chosen port, GID or LID.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_DEVICE_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_DEVICE_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <infiniband/verbs.h>

#include "absl/status/statusor.h"

#include "src/util/mutex.h"
#include "transport/rdma/rdma.pb.h"
#include "transport/rdma/rdma_address.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/verbs.h"

namespace kvwire::transport::rdma {

struct DevicePort {
  std::string name;
  uint8_t port = 1;
  // Declaration order is destruction order, reversed: CQ, channel, PD, context.
  Context ctx;
  Pd pd;
  CompChannel channel;
  Cq cq;
  ibv_device_attr attr{};
  ibv_port_attr port_attr{};
  bool ethernet = false;
  int gid_index = 0;
  ibv_gid gid{};
  std::string netdev;  // RoCE: the network interface of the GID ("" when unknown)
  uint32_t cq_size = 0;
  std::atomic<uint32_t> cq_reserved{0};  // CQ entries promised to QPs
  uint32_t qp_budget = 0;
  std::atomic<uint32_t> qps_in_use{0};  // QPs reserved (ReserveQp), both ends

  std::string Describe() const;  // "rxe0:1"
  pb::RdmaDevice ToProto() const;
  PortAddress Address() const;
  // OK while the port is usable; after a port error (until the port is ACTIVE again) or a
  // device fatal / CQ error event (for good): Unavailable naming the event.
  absl::Status Usable() const;
  // Asks the device (a system call): empty while the port is ACTIVE, else its state, e.g.
  // "DOWN". For error completions that may overtake the async event of their cause.
  std::string PortProblem() const;
  void MarkDown(const std::string& why, bool for_good);
  void MarkUp();
  // Reserves CQ room for a QP of `entries` WRs, or ResourceExhausted naming the device.
  absl::Status ReserveCq(uint32_t entries);
  void ReleaseCq(uint32_t entries) { cq_reserved -= entries; }
  // The QP budget (RdmaTransportOptions::max_qps_per_device, at most the device's max_qp):
  // reserves one QP for `peer` (named in the error), or ResourceExhausted naming the device,
  // the budget and the option.
  absl::Status ReserveQp(const std::string& peer);
  void ReleaseQp() { qps_in_use -= 1; }

 private:
  std::atomic<bool> usable_{true};
  mutable Mutex state_mu_;
  bool dead_ ABSL_GUARDED_BY(state_mu_) = false;
  std::string down_reason_ ABSL_GUARDED_BY(state_mu_);
};

// Opens every allowed device with an ACTIVE port. `skipped` gets one line per device or
// port left out, with the reason. NotFound when nothing is usable.
absl::StatusOr<std::vector<std::shared_ptr<DevicePort>>> OpenDevices(
    const RdmaTransportOptions& options, std::vector<std::string>* skipped);

std::string GidToString(const ibv_gid& gid);
const char* MtuName(ibv_mtu mtu);

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_DEVICE_H_
