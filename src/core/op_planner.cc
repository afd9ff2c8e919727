#include "src/core/op_planner.h"

#include <algorithm>

namespace kvwire::core {
namespace {

// Sorts `ops` and merges contiguous ones in place; returns how many remain at the front.
size_t Merge(absl::Span<transport::WireOp> ops) {
  if (ops.size() < 2) return ops.size();
  auto before = [](const transport::WireOp& a, const transport::WireOp& b) {
    if (a.remote_region != b.remote_region) return a.remote_region < b.remote_region;
    return a.remote_offset < b.remote_offset;
  };
  // Page lists mostly come in order already: one pass tells, and saves the n log n sort.
  // Only a strictly increasing list is left as it is (the order a sort would give it); one
  // with equal keys is sorted as before.
  bool sorted = true;
  for (size_t i = 1; i < ops.size() && sorted; ++i) sorted = before(ops[i - 1], ops[i]);
  if (!sorted) std::sort(ops.begin(), ops.end(), before);
  size_t kept = 1;
  for (size_t i = 1; i < ops.size(); ++i) {
    const transport::WireOp& op = ops[i];
    transport::WireOp& last = ops[kept - 1];
    if (last.remote_region == op.remote_region && last.local_region == op.local_region &&
        last.remote_offset + last.length == op.remote_offset &&
        last.local + last.length == op.local && last.local_gpu_device == op.local_gpu_device) {
      last.length += op.length;
      continue;
    }
    ops[kept++] = op;
  }
  return kept;
}

}  // namespace

Plan PlanOps(absl::Span<transport::WireOp> ops, const PlanLimits& limits) {
  Plan plan;
  const absl::Span<const transport::WireOp> merged = ops.first(Merge(ops));
  plan.merged_ops = merged.size();
  for (const transport::WireOp& op : merged) plan.total_bytes += op.length;
  if (merged.empty()) return plan;

  const uint32_t lanes = std::max<uint32_t>(1, limits.lanes);
  const bool stripe = lanes > 1 && plan.total_bytes >= limits.stripe_min_bytes;
  uint64_t piece_limit = std::max<uint64_t>(1, limits.max_op_bytes);
  uint64_t lane_target = plan.total_bytes;
  if (stripe) {
    lane_target = (plan.total_bytes + lanes - 1) / lanes;
    // Cut long ops so that every lane gets a share, in 4 KiB-aligned pieces.
    uint64_t share = std::max<uint64_t>(limits.min_piece_bytes, lane_target);
    share = (share + 4095) / 4096 * 4096;
    piece_limit = std::min(piece_limit, share);
  }

  plan.lanes.emplace_back();
  // Sized once, not grown by doubling (a request's page list is thousands of ops): a lane
  // takes its share of the merged ops, more only where long ops are cut.
  if (merged.size() > 1) plan.lanes.back().reserve(merged.size() / (stripe ? lanes : 1) + 1);
  uint64_t lane_bytes = 0;
  for (const transport::WireOp& op : merged) {
    for (uint64_t done = 0; done < op.length;) {
      const uint64_t len = std::min(piece_limit, op.length - done);
      if (stripe && lane_bytes >= lane_target && plan.lanes.size() < lanes) {
        plan.lanes.emplace_back();
        plan.lanes.back().reserve(merged.size() / lanes + 1);
        lane_bytes = 0;
      }
      plan.lanes.back().push_back(transport::WireOp{op.local + done, op.remote_region,
                                                    op.remote_offset + done, len,
                                                    op.local_gpu_device, op.local_region});
      lane_bytes += len;
      done += len;
      ++plan.pieces;
    }
  }
  return plan;
}

}  // namespace kvwire::core
