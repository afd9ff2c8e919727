#include "src/core/op_planner.h"

#include <algorithm>
#include <bit>

namespace kvwire::core {
namespace {

bool Before(const transport::WireOp& a, const transport::WireOp& b) {
  if (a.remote_region != b.remote_region) return a.remote_region < b.remote_region;
  return a.remote_offset < b.remote_offset;
}

// Whether `b` continues `a` both remotely and locally (then one op covers both).
bool Continues(const transport::WireOp& a, const transport::WireOp& b) {
  return a.remote_region == b.remote_region && a.local_region == b.local_region &&
         a.remote_offset + a.length == b.remote_offset && a.local + a.length == b.local &&
         a.local_gpu_device == b.local_gpu_device;
}

// Merges `from` (sorted) into `to` (which may be `from` itself: it is written behind the
// read position); returns how many ops remain.
size_t MergeSorted(const transport::WireOp* from, size_t count, transport::WireOp* to) {
  to[0] = from[0];
  size_t kept = 1;
  for (size_t i = 1; i < count; ++i) {
    transport::WireOp& last = to[kept - 1];
    if (Continues(last, from[i])) {
      last.length += from[i].length;
    } else {
      to[kept++] = from[i];
    }
  }
  return kept;
}

// Scratch of the packed-key sort, kept by each thread for its next transfer (planning a
// request's page list allocates nothing at steady state). A thread that once planned a
// huge transfer does not keep its buffers.
constexpr size_t kKeptScratchOps = size_t{1} << 16;
struct SortScratch {
  std::vector<uint64_t> keys;
  std::vector<transport::WireOp> ops;
  void Trim() {
    if (keys.capacity() > kKeptScratchOps) {
      keys = std::vector<uint64_t>();
      ops = std::vector<transport::WireOp>();
    }
  }
};
// Out of line: a reference to a thread_local in a shared library is otherwise recomputed
// (__tls_get_addr) at each use inside the loops below.
__attribute__((noinline)) SortScratch& ThreadScratch() {
  thread_local SortScratch scratch;
  return scratch;
}

// Sorts and merges through one 8-byte key per op, [region rank | offset | index], instead of
// moving 48-byte ops through the sort: the order is that of Before (ties, which valid ops
// never have, by position). False, with `ops` untouched, when the keys do not fit in 64 bits
// (many remote regions, or offsets and op counts too large to pack): the caller sorts the ops.
bool MergeByPackedKeys(absl::Span<transport::WireOp> ops, size_t* kept) {
  constexpr size_t kMaxRegions = 8;
  RegionId regions[kMaxRegions];
  size_t region_count = 0;
  uint64_t offsets_or = 0;
  uint64_t max_offset = 0;
  RegionId last = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const transport::WireOp& op = ops[i];
    offsets_or |= op.remote_offset;
    max_offset = std::max(max_offset, op.remote_offset);
    if ((i == 0 || op.remote_region != last) &&
        std::find(regions, regions + region_count, op.remote_region) == regions + region_count) {
      if (region_count == kMaxRegions) return false;
      regions[region_count++] = op.remote_region;
    }
    last = op.remote_region;
  }
  std::sort(regions, regions + region_count);
  // Offsets are mostly page-aligned: their common trailing zero bits carry no order.
  const int shift = offsets_or == 0 ? 0 : std::countr_zero(offsets_or);
  const int index_bits = std::bit_width(ops.size() - 1);
  const int offset_bits = std::bit_width(max_offset >> shift);
  const int rank_bits = std::bit_width(region_count - 1);
  if (index_bits + offset_bits + rank_bits > 64) return false;

  SortScratch& scratch = ThreadScratch();
  scratch.keys.resize(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const transport::WireOp& op = ops[i];
    uint64_t rank = 0;
    if (region_count > 1) {
      rank = static_cast<uint64_t>(
          std::lower_bound(regions, regions + region_count, op.remote_region) - regions);
    }
    // Shifts split in two: a shift by 64 (no offset or index bits) is undefined.
    const uint64_t high = (rank << offset_bits) | (op.remote_offset >> shift);
    scratch.keys[i] = ((high << (index_bits / 2)) << (index_bits - index_bits / 2)) | i;
  }
  std::sort(scratch.keys.begin(), scratch.keys.end());
  const uint64_t index_mask = (uint64_t{1} << index_bits) - 1;  // index_bits < 64
  scratch.ops.resize(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) scratch.ops[i] = ops[scratch.keys[i] & index_mask];
  *kept = MergeSorted(scratch.ops.data(), scratch.ops.size(), ops.data());
  scratch.Trim();
  return true;
}

// Sorts `ops` and merges contiguous ones in place; returns how many remain at the front.
size_t Merge(absl::Span<transport::WireOp> ops) {
  if (ops.size() < 2) return ops.size();
  // Page lists mostly come in order already: one pass tells, and saves the n log n sort.
  // Only a strictly increasing list is left as it is (the order a sort would give it); one
  // with equal keys is sorted as before.
  bool sorted = true;
  for (size_t i = 1; i < ops.size() && sorted; ++i) sorted = Before(ops[i - 1], ops[i]);
  if (!sorted) {
    size_t kept = 0;
    if (MergeByPackedKeys(ops, &kept)) return kept;
    std::sort(ops.begin(), ops.end(), Before);
  }
  return MergeSorted(ops.data(), ops.size(), ops.data());
}

}  // namespace

Plan PlanOps(absl::Span<transport::WireOp> ops, const PlanLimits& limits) {
  Plan plan;
  if (ops.size() == 1 && IsOnePiece(ops[0], limits)) {
    // One op that is neither cut nor striped (the common small transfer): what the general
    // path below gives it, without its passes.
    plan.lanes.emplace_back(1, ops[0]);
    plan.total_bytes = ops[0].length;
    plan.merged_ops = 1;
    plan.pieces = 1;
    return plan;
  }
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
