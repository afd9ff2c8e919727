#include "transport/rdma/rdma_qp_state.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"

#include "transport/rdma/rdma_address.h"

namespace kvwire::transport::rdma {

namespace {

absl::Status ModifyError(const char* state, const std::string& where, uint32_t qpn, int rc) {
  return absl::InternalError(absl::StrCat("ibv_modify_qp to ", state, " failed on ", where, " QP ",
                                          qpn, ": ", std::strerror(rc)));
}

}  // namespace

uint32_t RandomPsn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

absl::Status ToInit(ibv_qp* qp, const DevicePort& dev, int access) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = dev.port;
  a.qp_access_flags = access;
  const int rc = verbs().modify_qp(
      qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  return rc == 0 ? absl::OkStatus() : ModifyError("INIT", dev.Describe(), qp->qp_num, rc);
}

absl::Status ToRtr(ibv_qp* qp, const DevicePort& dev, const pb::RdmaDevice& remote,
                   uint32_t remote_qpn, uint32_t remote_psn, uint8_t max_dest_rd_atomic) {
  auto ah = RemoteAddress(dev.Address(), remote);
  if (!ah.ok()) return ah.status();
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = PathMtu(dev.port_attr.active_mtu, remote.mtu());
  a.dest_qp_num = remote_qpn;
  a.rq_psn = remote_psn;
  a.max_dest_rd_atomic = std::max<uint8_t>(1, max_dest_rd_atomic);
  a.min_rnr_timer = 12;  // 0.64 ms
  a.ah_attr = *ah;
  const int rc =
      verbs().modify_qp(qp, &a,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                            IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  return rc == 0 ? absl::OkStatus() : ModifyError("RTR", dev.Describe(), qp->qp_num, rc);
}

absl::Status ToRts(ibv_qp* qp, const DevicePort& dev, uint32_t psn, const RdmaTransportOptions& o,
                   uint8_t max_rd_atomic) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = psn;
  a.timeout = o.qp_timeout;
  a.retry_cnt = o.retry_count;
  a.rnr_retry = o.rnr_retry;
  a.max_rd_atomic = std::max<uint8_t>(1, max_rd_atomic);
  const int rc =
      verbs().modify_qp(qp, &a,
                        IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                            IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  return rc == 0 ? absl::OkStatus() : ModifyError("RTS", dev.Describe(), qp->qp_num, rc);
}

}  // namespace kvwire::transport::rdma
