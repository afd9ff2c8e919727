// Turns a transfer's validated ops into per-lane work: contiguous ops merged, long ones
// split, the result striped over lanes (connections, QPs) when the transfer is big enough
// for striping to pay.
#ifndef KVWIRE_CORE_OP_PLANNER_H_
#define KVWIRE_CORE_OP_PLANNER_H_

#include <cstdint>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"

#include "transport/transport.h"

namespace kvwire::core {

struct PlanLimits {
  uint64_t max_op_bytes = 1 << 20;        // no piece longer than this
  uint32_t lanes = 1;                     // lanes available
  uint64_t stripe_min_bytes = 256 << 10;  // below this, one lane
  uint64_t min_piece_bytes = 64 << 10;    // striping never cuts pieces smaller than this
};

struct Plan {
  absl::InlinedVector<transport::WireOps, 1> lanes;  // non-empty lanes only
  uint64_t total_bytes = 0;
  uint64_t merged_ops = 0;  // after merging, before splitting
  uint64_t pieces = 0;      // after splitting (what goes on the wire)
};

// Whether PlanOps plans `op`, alone in its transfer, as one piece on one lane (neither cut by
// max_op_bytes nor striped): the common small transfer, which a caller may then post as it is.
inline bool IsOnePiece(const transport::WireOp& op, const PlanLimits& limits) {
  return op.length > 0 && op.length <= limits.max_op_bytes &&
         (limits.lanes <= 1 || op.length < limits.stripe_min_bytes);
}

// Ops are merged when one continues the other both locally and in the same remote region;
// order between ops of one transfer carries no meaning (they must not overlap).
// `ops` is reordered (sorted for merging) in place; a one-op transfer is planned without
// allocating.
Plan PlanOps(absl::Span<transport::WireOp> ops, const PlanLimits& limits);
inline Plan PlanOps(std::vector<transport::WireOp> ops, const PlanLimits& limits) {
  return PlanOps(absl::MakeSpan(ops), limits);
}

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_OP_PLANNER_H_
