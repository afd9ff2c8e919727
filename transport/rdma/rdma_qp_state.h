// The ibv_modify_qp transitions of an RC QP (INIT, RTR, RTS) and its initial packet sequence
// number; errors name the device, the QPN and the target state.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_QP_STATE_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_QP_STATE_H_

#include <cstdint>

#include "absl/status/status.h"

#include "transport/rdma/rdma.pb.h"
#include "transport/rdma/rdma_device.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/verbs.h"

namespace kvwire::transport::rdma {

// A random 24-bit PSN.
uint32_t RandomPsn();

absl::Status ToInit(ibv_qp* qp, const DevicePort& dev, int access);

absl::Status ToRtr(ibv_qp* qp, const DevicePort& dev, const pb::RdmaDevice& remote,
                   uint32_t remote_qpn, uint32_t remote_psn, uint8_t max_dest_rd_atomic);

absl::Status ToRts(ibv_qp* qp, const DevicePort& dev, uint32_t psn, const RdmaTransportOptions& o,
                   uint8_t max_rd_atomic);

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_QP_STATE_H_
