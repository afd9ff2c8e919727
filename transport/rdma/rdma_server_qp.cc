#include "transport/rdma/rdma_server_qp.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

#include "src/util/fault_injection.h"
#include "src/util/log.h"
#include "transport/rdma/rdma_plan.h"
#include "transport/rdma/rdma_qp_state.h"

namespace kvwire::transport::rdma {

absl::StatusOr<pb::RdmaQpInfo> ServerQp::Create(const pb::RdmaQpInfo& remote,
                                                const pb::RdmaDevice& remote_dev,
                                                const RdmaTransportOptions& o) {
  const std::string where = dev_->Describe();
  const uint32_t depth = std::min<uint32_t>(o.recv_queue_depth, dev_->attr.max_qp_wr);
  if (absl::Status s = dev_->ReserveQp(absl::StrCat(peer_)); !s.ok()) return s;
  holds_qp_ = true;
  if (absl::Status s = dev_->ReserveCq(depth + 1); !s.ok()) return s;
  reserved_ = depth + 1;
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  table_mr_.reset(
      verbs().reg_mr(pd_->pd.get(), table_.data(), table_.size() * sizeof(uint64_t), access));
  if (!table_mr_) {
    return absl::InternalError(
        absl::StrCat("ibv_reg_mr of the slot table on ", where, ": ", std::strerror(errno)));
  }
  ibv_qp_init_attr init{};
  init.send_cq = dev_->cq.get();
  init.recv_cq = dev_->cq.get();
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = 1;
  init.cap.max_recv_wr = depth;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  qp_.reset(verbs().create_qp(pd_->pd.get(), &init));
  if (!qp_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ibv_create_qp (target) on ", where, ": ", std::strerror(errno)));
  }
  if (absl::Status s =
          ToInit(qp_.get(), *dev_,
                 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
      !s.ok()) {
    return s;
  }
  for (uint32_t i = 0; i < depth; ++i) {
    if (absl::Status s = PostRecv(); !s.ok()) return s;
  }
  const uint8_t rd = static_cast<uint8_t>(std::min(dev_->attr.max_qp_rd_atom, 16));
  if (absl::Status s = ToRtr(qp_.get(), *dev_, remote_dev, remote.qpn(), remote.psn(), rd);
      !s.ok()) {
    return s;
  }
  const uint32_t psn = RandomPsn();
  if (absl::Status s = ToRts(qp_.get(), *dev_, psn, o, 1); !s.ok()) return s;
  pb::RdmaQpInfo info;
  info.set_index(index_);
  info.set_qpn(qp_->qp_num);
  info.set_psn(psn);
  info.set_slot_table_addr(reinterpret_cast<uint64_t>(table_.data()));
  info.set_slot_table_rkey(table_mr_->rkey);
  info.set_max_rd_atomic(rd);
  return info;
}

absl::Status ServerQp::PostRecv() {
  ibv_sge sge{reinterpret_cast<uint64_t>(&table_[kSlotsPerQp]), 8, table_mr_->lkey};
  ibv_recv_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = verbs().post_recv(qp_.get(), &wr, &bad);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("ibv_post_recv on ", dev_->Describe(), " QP ",
                                            qp_->qp_num, ": ", std::strerror(rc)));
  }
  return absl::OkStatus();
}

void ServerQp::OnCompletion(const ibv_wc& wc, TargetHooks* hooks) {
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR) {
      KVW_LOG(kWarning, "rdma") << "target QP error" << Kv("device", dev_->Describe())
                                << Kv("qpn", wc.qp_num) << Kv("peer", peer_)
                                << Kv("channel", channel_) << Kv("index", index_)
                                << Kv("status", ibv_wc_status_str(wc.status));
    }
    return;
  }
  if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM) return;
  uint32_t slot = 0, count = 0;
  DecodeImm(ntohl(wc.imm_data), &slot, &count);
  const TransferId id = __atomic_load_n(&table_[slot], __ATOMIC_ACQUIRE);
  for (uint32_t i = 0; i < count; ++i) hooks->OnWriteArrived(peer_, id);
  if (fault_injection::TakeQpError(fault_injection::QpEnd::kTarget)) {
    // Test hook: this QP breaks here, as at a peer whose QP hit an error.
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    const int rc = verbs().modify_qp(qp_.get(), &attr, IBV_QP_STATE);
    KVW_LOG(kWarning, "rdma") << "test hook: target QP forced to the error state"
                              << Kv("qpn", wc.qp_num) << Kv("peer", peer_) << Kv("rc", rc);
    return;
  }
  if (absl::Status s = PostRecv(); !s.ok()) {
    KVW_LOG(kError, "rdma") << "receive not replenished" << Kv("error", s.message());
  }
}

}  // namespace kvwire::transport::rdma
