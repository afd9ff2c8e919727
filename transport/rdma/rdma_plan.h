// The verbs-independent part of the rdma transport: immediate-data encoding, completion
// slots, send-queue admission, work-request planning (merging, scatter/gather, chaining,
// selective signalling) and lane striping. Unit-tested and benchmarked without a device.
//
// How a counted WRITE lane travels (see rdma_transport.h for the whole design):
//   1. the initiator takes a free slot s of the QP and RDMA-WRITEs the 64-bit transfer id
//      into the target's per-QP slot table at index s ("bind", 8 bytes, inline);
//   2. the data WRs follow on the same QP as plain RDMA WRITEs;
//   3. the last one is RDMA WRITE WITH IMMEDIATE, imm = EncodeImm(s, pieces of the lane).
// RC delivers a QP's messages in order, so when the target sees the immediate, the slot
// already holds the transfer id and every piece of the lane is in memory: it reports
// `pieces` arrivals of that id. Slot s returns to the pool when the initiator's completion of
// the immediate WRITE arrives, i.e. after the target consumed it: no wrap-around, 64-bit ids.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_PLAN_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_PLAN_H_

#include <cstdint>
#include <optional>
#include <vector>

#include <infiniband/verbs.h>

namespace kvwire::transport::rdma {

// --- immediate data: [slot : kSlotBits][count : 32 - kSlotBits] ---------------------------
inline constexpr uint32_t kSlotBits = 12;
inline constexpr uint32_t kSlotsPerQp = 1u << kSlotBits;
inline constexpr uint32_t kMaxCountPerImm = (1u << (32 - kSlotBits)) - 1;

// `slot` < kSlotsPerQp, 1 <= `count` <= kMaxCountPerImm. Host byte order (the caller
// converts with htonl for ibv_send_wr::imm_data).
uint32_t EncodeImm(uint32_t slot, uint32_t count);
void DecodeImm(uint32_t imm, uint32_t* slot, uint32_t* count);

// Free slots of one QP's table. Not thread-safe (the QP's lock guards it).
class SlotPool {
 public:
  explicit SlotPool(uint32_t slots = kSlotsPerQp);
  std::optional<uint32_t> Acquire();
  void Release(uint32_t slot);
  uint32_t available() const { return static_cast<uint32_t>(free_.size()); }

 private:
  std::vector<uint32_t> free_;
};

// Send-queue admission of one QP. WRs get consecutive sequence numbers; a signalled
// completion of sequence s retires every WR up to s (RC completes in order), so at most
// `depth` WRs are ever outstanding and ibv_post_send never sees a full queue.
class SendWindow {
 public:
  explicit SendWindow(uint32_t depth) : depth_(depth) {}
  uint32_t depth() const { return depth_; }
  uint32_t free() const { return depth_ - static_cast<uint32_t>(posted_ - completed_); }
  uint64_t outstanding() const { return posted_ - completed_; }
  // Reserves `n` <= free() WRs; returns the sequence number of the first.
  uint64_t Reserve(uint32_t n);
  // A signalled completion of `seq` arrived; returns how many WRs it retired.
  uint64_t Complete(uint64_t seq);
  uint64_t completed() const { return completed_; }  // WRs retired so far (= last seq + 1)

 private:
  uint32_t depth_;
  uint64_t posted_ = 0;
  uint64_t completed_ = 0;
};

// Whether the WR at `index` of a chain of `chain_length` is signalled: the last always, and
// every `interval`-th so that long chains retire send-queue space before they end.
inline bool IsSignalled(uint32_t index, uint32_t chain_length, uint32_t interval) {
  return index + 1 == chain_length || (interval != 0 && (index + 1) % interval == 0);
}

// --- work-request planning ----------------------------------------------------------------
// One op with its keys resolved.
struct ResolvedOp {
  uint64_t local_addr = 0;
  uint32_t lkey = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint64_t length = 0;
};

struct PlannedWr {
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t sge_begin = 0;  // index into WrPlan::sges
  uint32_t sge_count = 0;
  uint64_t bytes = 0;
};

struct WrPlan {
  std::vector<PlannedWr> wrs;
  std::vector<ibv_sge> sges;
  void clear() {
    wrs.clear();
    sges.clear();
  }
};

struct WrLimits {
  uint32_t max_sge = 1;                // the QP's max_send_sge (>= 1)
  uint64_t max_wr_bytes = 1ull << 30;  // the port's max_msg_sz
};

// Appends the WRs for `ops` (in order) to `plan`: an op whose remote range continues the
// previous WR's (same rkey) joins that WR; its local range extends the last SGE when it is
// contiguous too (same lkey), else takes a new SGE while the WR has fewer than max_sge.
void PlanWrs(const ResolvedOp* ops, size_t count, const WrLimits& limits, WrPlan* plan);

// Fills `out[0..n)` (and links them with `next`) for plan.wrs[first, first+n): opcode,
// addresses, keys, SGEs, inline when bytes <= max_inline, signalling, and wr_id = first_seq +
// i | wr_id_tag. The last of the n is signalled (the caller links several such runs into one
// chain for one ibv_post_send). Returns the number signalled.
uint32_t FillChain(const WrPlan& plan, size_t first, uint32_t n, ibv_wr_opcode opcode,
                   uint32_t max_inline, uint32_t signal_interval, uint64_t first_seq,
                   uint64_t wr_id_tag, ibv_send_wr* out);

// --- striping -------------------------------------------------------------------------------
// Lane `lane` of a transfer runs on QP (device, index): lanes go round-robin over devices
// first, then over the QPs of a device.
struct QpAddress {
  uint32_t device = 0;
  uint32_t qp = 0;
};
inline QpAddress LaneToQp(uint32_t lane, uint32_t devices, uint32_t qps_per_device) {
  return QpAddress{lane % devices, (lane / devices) % qps_per_device};
}

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_PLAN_H_
