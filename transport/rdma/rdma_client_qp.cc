#include "transport/rdma/rdma_client_qp.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

#include "src/util/fault_injection.h"
#include "src/util/log.h"
#include "transport/rdma/rdma_qp_state.h"
#include "transport/rdma/rdma_transport_impl.h"

namespace kvwire::transport::rdma {

namespace {

constexpr uint64_t kSeqMask = (1ull << 48) - 1;

absl::StatusCode CodeForWc(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
      return absl::StatusCode::kPermissionDenied;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_WR_FLUSH_ERR:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

const char* WcHint(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_REM_ACCESS_ERR:
      return " (remote access error: the remote range or rkey is outside the peer's "
             "registration, or the region does not allow this access)";
    case IBV_WC_RETRY_EXC_ERR:
      return " (no acknowledgement from the peer: dead, unreachable or wedged)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return " (the peer had no receive posted)";
    case IBV_WC_FATAL_ERR:
      // Soft-RoCE (Linux 6.1's rxe) completes a WR so when a READ response reaches a WRITE
      // after a retransmitted READ was renumbered (tests/rdma/README.md).
      return " (the device failed the QP; it is re-created on next use)";
    default:
      return "";
  }
}

void RunFinished(std::vector<Finished>& finished) {
  for (Finished& f : finished) f.done(std::move(f.status));
  finished.clear();
}

}  // namespace

absl::StatusOr<pb::RdmaQpInfo> ClientQp::Prepare() {
  MutexLock lock(&mu_);
  if (state_ == State::kClosed) return absl::CancelledError("rdma channel closed");
  DestroyLocked();
  const std::string where = dev_->Describe();
  const uint32_t depth = std::min<uint32_t>(options_.send_queue_depth, dev_->attr.max_qp_wr);
  if (absl::Status s = dev_->ReserveQp(core_->peer_name); !s.ok()) return s;
  holds_qp_ = true;
  if (absl::Status s = dev_->ReserveCq(depth + 1); !s.ok()) return s;
  reserved_ = depth + 1;
  if (!bind_mr_) {
    const int access = IBV_ACCESS_LOCAL_WRITE;
    bind_mr_.reset(verbs().reg_mr(dev_->pd.get(), bind_src_.data(),
                                  bind_src_.size() * sizeof(uint64_t), access));
    if (!bind_mr_) {
      return absl::InternalError(
          absl::StrCat("ibv_reg_mr of the bind buffer on ", where, ": ", std::strerror(errno)));
    }
  }
  ibv_qp_init_attr init{};
  init.send_cq = dev_->cq.get();
  init.recv_cq = dev_->cq.get();
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;
  init.cap.max_send_wr = depth;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = static_cast<uint32_t>(std::max(1, dev_->attr.max_sge));
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = options_.max_inline;
  qp_.reset(verbs().create_qp(dev_->pd.get(), &init));
  if (!qp_ && options_.max_inline != 0) {  // the device may refuse inline data
    init.cap.max_inline_data = 0;
    qp_.reset(verbs().create_qp(dev_->pd.get(), &init));
  }
  if (!qp_) {
    return absl::ResourceExhaustedError(absl::StrCat("ibv_create_qp on ", where, " for peer ",
                                                     core_->peer_name, ": ", std::strerror(errno)));
  }
  max_inline_ = init.cap.max_inline_data;
  max_sge_ = std::max<uint32_t>(1, init.cap.max_send_sge);
  window_ = SendWindow(depth);
  slots_ = SlotPool(std::min<uint32_t>(kSlotsPerQp, options_.recv_queue_depth));
  scratch_.assign(depth, ibv_send_wr{});
  ++generation_;
  tag_ = (generation_ & 0xffff) << 48;
  psn_ = RandomPsn();
  if (absl::Status s = ToInit(qp_.get(), *dev_, 0); !s.ok()) return s;
  loop_->AddClient(qp_->qp_num, weak_from_this());
  state_ = State::kConnecting;
  pb::RdmaQpInfo info;
  info.set_index(index_);
  info.set_qpn(qp_->qp_num);
  info.set_psn(psn_);
  return info;
}

absl::Status ClientQp::Finish(const pb::RdmaQpInfo& remote) {
  std::vector<Finished> finished;
  absl::Status status;
  {
    MutexLock lock(&mu_);
    if (state_ == State::kClosed || !qp_) {
      return absl::CancelledError("channel closed during QP setup");
    }
    const pb::RdmaDevice& rdev = core_->remote.devices(static_cast<int>(remote_device_));
    status = ToRtr(qp_.get(), *dev_, rdev, remote.qpn(), remote.psn(),
                   static_cast<uint8_t>(std::min(dev_->attr.max_qp_rd_atom, 16)));
    if (status.ok()) {
      const uint8_t rd = static_cast<uint8_t>(std::min<uint32_t>(
          static_cast<uint32_t>(dev_->attr.max_qp_init_rd_atom), remote.max_rd_atomic()));
      status = ToRts(qp_.get(), *dev_, psn_, options_, rd);
    }
    if (status.ok()) {
      remote_table_ = remote.slot_table_addr();
      remote_table_rkey_ = remote.slot_table_rkey();
      state_ = State::kReady;
      reconnecting_ = false;
      PumpLocked(&finished);
    }
  }
  RunFinished(finished);
  return status;
}

void ClientQp::SetupFailed(const absl::Status& status) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    reconnecting_ = false;
    if (state_ == State::kClosed) return;
    state_ = State::kBroken;
    while (!queued_.empty()) {
      auto lane = std::move(queued_.front());
      queued_.pop_front();
      FinishLaneLocked(std::move(lane),
                       absl::Status(status.code(),
                                    absl::StrCat("re-creating QP ", index_, " on ",
                                                 dev_->Describe(), " failed: ", status.message())),
                       &finished);
    }
  }
  RunFinished(finished);
}

void ClientQp::Enqueue(std::unique_ptr<Lane> lane) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    absl::Status usable = dev_->Usable();
    if (state_ == State::kClosed) {
      FinishLaneLocked(
          std::move(lane),
          absl::UnavailableError(absl::StrCat("rdma channel to ", core_->peer_name, " is closed")),
          &finished);
    } else if (!usable.ok()) {
      // Port down or device dead: fail now rather than after the QP's retries.
      FinishLaneLocked(std::move(lane),
                       absl::UnavailableError(
                           absl::StrCat("rdma transfer ", lane->request.transfer_id, " to peer ",
                                        core_->peer_name, " refused: ", usable.message())),
                       &finished);
    } else {
      const Lane* added = lane.get();
      queued_.push_back(std::move(lane));
      const bool ready = state_ == State::kReady;
      if (ready) PumpLocked(&finished);
      if (state_ == State::kBroken) ScheduleReconnectLocked();
      // Admission control: WRs of this lane that found the send queue (or the slots) full.
      if (ready) {
        for (auto it = queued_.rbegin(); it != queued_.rend(); ++it) {
          if (it->get() != added) continue;
          counters_->queued_wrs.fetch_add(added->plan.wrs.size() - added->next_wr,
                                          std::memory_order_relaxed);
          break;
        }
      }
    }
  }
  RunFinished(finished);
}

void ClientQp::ScheduleReconnectLocked() {
  if (reconnecting_ || state_ != State::kBroken) return;
  reconnecting_ = true;
  core_->transport->ScheduleReconnect(shared_from_this());
}

void ClientQp::FinishLaneLocked(std::unique_ptr<Lane> lane, absl::Status status,
                                std::vector<Finished>* finished) {
  if (lane->slot) slots_.Release(*lane->slot);
  finished->push_back(Finished{std::move(lane->done), std::move(status)});
}

void ClientQp::PumpLocked(std::vector<Finished>* finished) {
  if (state_ != State::kReady) return;
  uint32_t n = 0;
  uint32_t signalled = 0;
  uint32_t inlined = 0;
  ibv_send_wr* prev_last = nullptr;
  while (!queued_.empty()) {
    Lane& lane = *queued_.front();
    if (lane.next_wr == 0) {
      if (lane.request.cancelled && lane.request.cancelled->load()) {
        auto done = std::move(queued_.front());
        queued_.pop_front();
        FinishLaneLocked(std::move(done),
                         absl::CancelledError(absl::StrCat("transfer ", lane.request.transfer_id,
                                                           " ended before it was posted")),
                         finished);
        continue;
      }
      if (lane.counted && !lane.slot) {
        std::optional<uint32_t> slot = slots_.Acquire();
        if (!slot) break;  // every slot in flight: wait for completions
        lane.slot = slot;
        bind_src_[*slot] = lane.request.transfer_id;
        lane.plan.wrs[0].remote_addr = remote_table_ + uint64_t{*slot} * sizeof(uint64_t);
        lane.plan.wrs[0].rkey = remote_table_rkey_;
        lane.plan.sges[0].addr = reinterpret_cast<uint64_t>(&bind_src_[*slot]);
        lane.plan.sges[0].lkey = bind_mr_->lkey;
      }
    }
    const uint32_t free = window_.free();
    if (free == 0) break;
    const uint32_t remaining = static_cast<uint32_t>(lane.plan.wrs.size() - lane.next_wr);
    const uint32_t k = std::min(free, remaining);
    const uint64_t seq = window_.Reserve(k);
    signalled +=
        FillChain(lane.plan, lane.next_wr, k, lane.opcode, lane.local_gpu ? 0 : max_inline_,
                  options_.signal_interval, seq, tag_, &scratch_[n]);
    for (uint32_t i = n; i < n + k; ++i) inlined += (scratch_[i].send_flags & IBV_SEND_INLINE) != 0;
    if (prev_last != nullptr) prev_last->next = &scratch_[n];
    prev_last = &scratch_[n + k - 1];
    lane.next_wr += k;
    n += k;
    if (lane.next_wr < lane.plan.wrs.size()) break;  // window full
    if (lane.counted) {
      prev_last->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      prev_last->imm_data = htonl(EncodeImm(*lane.slot, lane.pieces));
    }
    lane.last_seq = seq + k - 1;
    posted_.push_back(std::move(queued_.front()));
    queued_.pop_front();
  }
  if (n == 0) return;
  if (fault_injection::TakeQpError(fault_injection::QpEnd::kInitiator)) {
    // Test hook: the QP breaks just before this post, whose work requests then flush.
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    const int rc = verbs().modify_qp(qp_.get(), &attr, IBV_QP_STATE);
    KVW_LOG(kWarning, "rdma") << "test hook: initiator QP forced to the error state"
                              << Kv("qpn", qp_->qp_num) << Kv("rc", rc);
  }
  ibv_send_wr* bad = nullptr;
  const int rc = verbs().post_send(qp_.get(), scratch_.data(), &bad);
  counters_->post_calls.fetch_add(1, std::memory_order_relaxed);
  counters_->wrs.fetch_add(n, std::memory_order_relaxed);
  counters_->signalled.fetch_add(signalled, std::memory_order_relaxed);
  counters_->inline_wrs.fetch_add(inlined, std::memory_order_relaxed);
  if (rc != 0) {
    BreakLocked(absl::InternalError(absl::StrCat("ibv_post_send on ", dev_->Describe(), " QP ",
                                                 qp_->qp_num, " failed: ", std::strerror(rc))),
                nullptr, finished);
  }
}

void ClientQp::OnCompletion(const ibv_wc& wc) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    if ((wc.wr_id & ~kSeqMask) != tag_ || state_ == State::kClosed) return;  // stale
    const uint64_t seq = wc.wr_id & kSeqMask;
    if (wc.status == IBV_WC_SUCCESS) {
      if (state_ != State::kReady) return;
      window_.Complete(seq);
      while (!posted_.empty() && posted_.front()->last_seq <= seq) {
        auto lane = std::move(posted_.front());
        posted_.pop_front();
        FinishLaneLocked(std::move(lane), absl::OkStatus(), &finished);
      }
      PumpLocked(&finished);
    } else if (state_ == State::kReady) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) {
        counters_->completion_errors.fetch_add(1, std::memory_order_relaxed);
      }
      // The first error; the flushes that follow it are ignored (state is broken then).
      const Lane* culprit = nullptr;
      for (const auto& lane : posted_) {
        if (lane->last_seq >= seq) {
          culprit = lane.get();
          break;
        }
      }
      if (culprit == nullptr && !queued_.empty() && queued_.front()->next_wr > 0) {
        culprit = queued_.front().get();
      }
      const TransferId id = culprit ? culprit->request.transfer_id : 0;
      const char* verb = culprit && culprit->opcode == IBV_WR_RDMA_READ ? "READ" : "WRITE";
      std::string message =
          absl::StrCat("rdma ", verb, " of transfer ", id, " failed on ", dev_->Describe(), " QP ",
                       wc.qp_num, " to peer ", core_->peer_name, ": ", ibv_wc_status_str(wc.status),
                       " (vendor error 0x", absl::Hex(wc.vendor_err), ")", WcHint(wc.status));
      absl::StatusCode code = CodeForWc(wc.status);
      // A port going down fails QPs before its async event is read: name the cause now.
      if (std::string port = dev_->PortProblem(); !port.empty()) {
        const std::string why = absl::StrCat("port error: ", dev_->Describe(), " is ", port);
        dev_->MarkDown(why, false);
        absl::StrAppend(&message, "; ", why);
        code = absl::StatusCode::kUnavailable;
      }
      BreakLocked(absl::Status(code, message), culprit, &finished);
    }
  }
  RunFinished(finished);
}

void ClientQp::BreakLocked(const absl::Status& status, const Lane* culprit,
                           std::vector<Finished>* finished) {
  if (state_ == State::kClosed) return;
  state_ = State::kBroken;
  if (qp_) {
    // ERROR flushes what is still queued: no READ response lands in memory whose lane is
    // reported below (the flush completions that follow are ignored).
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    if (const int rc = verbs().modify_qp(qp_.get(), &attr, IBV_QP_STATE); rc != 0) {
      KVW_LOG(kWarning, "rdma") << "QP not moved to ERROR; destroying it" << Kv("qpn", qp_->qp_num)
                                << Kv("error", std::strerror(rc));
      DestroyLocked();
    }
  }
  KVW_LOG(kWarning, "rdma") << "QP failed; it is re-created on next use"
                            << Kv("device", dev_->Describe()) << Kv("qpn", qp_ ? qp_->qp_num : 0)
                            << Kv("peer", core_->peer_name) << Kv("error", status.message());
  // The culprit gets `status`; the other lanes say they were flushed by it.
  std::vector<std::unique_ptr<Lane>> failing;
  while (!posted_.empty()) {
    failing.push_back(std::move(posted_.front()));
    posted_.pop_front();
  }
  // A partly posted lane fails; lanes not posted at all wait for the new QP.
  if (!queued_.empty() && queued_.front()->next_wr > 0) {
    failing.push_back(std::move(queued_.front()));
    queued_.pop_front();
  }
  for (auto& lane : failing) {
    const bool is_culprit = lane.get() == culprit || culprit == nullptr;
    absl::Status s =
        is_culprit
            ? status
            : absl::Status(status.code(), absl::StrCat("rdma transfer ", lane->request.transfer_id,
                                                       " flushed: ", status.message()));
    FinishLaneLocked(std::move(lane), std::move(s), finished);
  }
  if (!queued_.empty()) ScheduleReconnectLocked();
}

void ClientQp::Break(const absl::Status& status) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    if (state_ == State::kReady || state_ == State::kConnecting) {
      BreakLocked(status, nullptr, &finished);
    }
  }
  RunFinished(finished);
}

void ClientQp::Close(const absl::Status& status) {
  std::vector<Finished> finished;
  {
    MutexLock lock(&mu_);
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    // Destroy first: nothing touches local memory once the QP is gone.
    DestroyLocked();
    for (auto* list : {&posted_, &queued_}) {
      while (!list->empty()) {
        FinishLaneLocked(std::move(list->front()), status, &finished);
        list->pop_front();
      }
    }
    bind_mr_.reset();
  }
  RunFinished(finished);
}

void ClientQp::DestroyLocked() {
  if (qp_) {
    loop_->Remove(qp_->qp_num);
    qp_.reset();
  }
  if (reserved_ != 0) {
    dev_->ReleaseCq(reserved_);
    reserved_ = 0;
  }
  if (holds_qp_) {
    dev_->ReleaseQp();
    holds_qp_ = false;
  }
}

}  // namespace kvwire::transport::rdma
