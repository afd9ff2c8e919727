#include "transport/rdma/rdma_plan.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

namespace kvwire::transport::rdma {

uint32_t EncodeImm(uint32_t slot, uint32_t count) {
  return (slot << (32 - kSlotBits)) | (count & kMaxCountPerImm);
}

void DecodeImm(uint32_t imm, uint32_t* slot, uint32_t* count) {
  *slot = imm >> (32 - kSlotBits);
  *count = imm & kMaxCountPerImm;
}

SlotPool::SlotPool(uint32_t slots) {
  free_.reserve(slots);
  for (uint32_t i = slots; i > 0; --i) free_.push_back(i - 1);
}

std::optional<uint32_t> SlotPool::Acquire() {
  if (free_.empty()) return std::nullopt;
  const uint32_t slot = free_.back();
  free_.pop_back();
  return slot;
}

void SlotPool::Release(uint32_t slot) { free_.push_back(slot); }

uint64_t SendWindow::Reserve(uint32_t n) {
  const uint64_t first = posted_;
  posted_ += n;
  return first;
}

uint64_t SendWindow::Complete(uint64_t seq) {
  if (seq + 1 <= completed_) return 0;  // an older signal (cannot happen with RC ordering)
  const uint64_t retired = seq + 1 - completed_;
  completed_ = seq + 1;
  return retired;
}

void PlanWrs(const ResolvedOp* ops, size_t count, const WrLimits& limits, WrPlan* plan) {
  const uint32_t max_sge = std::max<uint32_t>(1, limits.max_sge);
  bool can_join = false;  // the last WR was made by this call (never join a caller's WR)
  for (size_t i = 0; i < count; ++i) {
    const ResolvedOp& op = ops[i];
    uint64_t done = 0;
    while (done < op.length) {
      const uint64_t local = op.local_addr + done;
      const uint64_t remote = op.remote_addr + done;
      uint64_t len = op.length - done;
      PlannedWr* wr = can_join ? &plan->wrs.back() : nullptr;
      if (wr != nullptr && wr->rkey == op.rkey && wr->remote_addr + wr->bytes == remote &&
          wr->bytes < limits.max_wr_bytes) {
        len = std::min(len, limits.max_wr_bytes - wr->bytes);
        ibv_sge& last = plan->sges.back();
        if (last.lkey == op.lkey && last.addr + last.length == local &&
            uint64_t{last.length} + len <= UINT32_MAX) {
          last.length += static_cast<uint32_t>(len);
          wr->bytes += len;
          done += len;
          continue;
        }
        if (wr->sge_count < max_sge) {
          len = std::min<uint64_t>(len, UINT32_MAX);
          plan->sges.push_back(ibv_sge{local, static_cast<uint32_t>(len), op.lkey});
          ++wr->sge_count;
          wr->bytes += len;
          done += len;
          continue;
        }
      }
      len = std::min({len, limits.max_wr_bytes, uint64_t{UINT32_MAX}});
      PlannedWr next;
      next.remote_addr = remote;
      next.rkey = op.rkey;
      next.sge_begin = static_cast<uint32_t>(plan->sges.size());
      next.sge_count = 1;
      next.bytes = len;
      plan->sges.push_back(ibv_sge{local, static_cast<uint32_t>(len), op.lkey});
      plan->wrs.push_back(next);
      can_join = true;
      done += len;
    }
  }
}

uint32_t FillChain(const WrPlan& plan, size_t first, uint32_t n, ibv_wr_opcode opcode,
                   uint32_t max_inline, uint32_t signal_interval, uint64_t first_seq,
                   uint64_t wr_id_tag, ibv_send_wr* out) {
  uint32_t signalled = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const PlannedWr& p = plan.wrs[first + i];
    ibv_send_wr& wr = out[i];
    wr.wr_id = wr_id_tag | (first_seq + i);
    wr.next = i + 1 < n ? &out[i + 1] : nullptr;
    // The plan's SGE array is stable while the chain is posted; verbs only reads it.
    wr.sg_list = const_cast<ibv_sge*>(&plan.sges[p.sge_begin]);
    wr.num_sge = static_cast<int>(p.sge_count);
    wr.opcode = opcode;
    wr.send_flags = 0;
    if (IsSignalled(i, n, signal_interval)) {
      wr.send_flags |= IBV_SEND_SIGNALED;
      ++signalled;
    }
    if (opcode != IBV_WR_RDMA_READ && p.bytes <= max_inline) wr.send_flags |= IBV_SEND_INLINE;
    wr.imm_data = 0;
    wr.wr.rdma.remote_addr = p.remote_addr;
    wr.wr.rdma.rkey = p.rkey;
  }
  return signalled;
}

}  // namespace kvwire::transport::rdma
