#include "src/core/op_planner.h"

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace kvwire::core {
namespace {

std::byte* At(std::vector<std::byte>& buf, size_t offset) { return buf.data() + offset; }

uint64_t Bytes(const Plan& plan) {
  uint64_t total = 0;
  for (const auto& lane : plan.lanes)
    for (const auto& op : lane) total += op.length;
  return total;
}

TEST(OpPlannerTest, MergesOpsContiguousOnBothSides) {
  std::vector<std::byte> local(1 << 20);
  std::vector<transport::WireOp> ops = {
      {At(local, 4096), 7, 8192, 4096},  // given out of order on purpose
      {At(local, 0), 7, 4096, 4096},
      {At(local, 8192), 7, 12288, 4096},
  };
  Plan plan = PlanOps(ops, PlanLimits{});
  ASSERT_EQ(plan.lanes.size(), 1u);
  ASSERT_EQ(plan.lanes[0].size(), 1u);
  EXPECT_EQ(plan.lanes[0][0].local, At(local, 0));
  EXPECT_EQ(plan.lanes[0][0].remote_offset, 4096u);
  EXPECT_EQ(plan.lanes[0][0].length, 12288u);
  EXPECT_EQ(plan.merged_ops, 1u);
  EXPECT_EQ(plan.pieces, 1u);
}

// A transport finds a piece's local region by id (WireOp::local_region): pieces keep it, and
// ops of two local regions that happen to be adjacent in memory are not merged.
TEST(OpPlannerTest, PiecesKeepTheirLocalRegion) {
  std::vector<std::byte> local(1 << 20);
  std::vector<transport::WireOp> ops = {
      {At(local, 0), 7, 0, 8192, -1, /*local_region=*/3},
      {At(local, 8192), 7, 8192, 4096, -1, /*local_region=*/4},  // adjacent on both sides
  };
  PlanLimits limits;
  limits.max_op_bytes = 4096;
  Plan plan = PlanOps(ops, limits);
  ASSERT_EQ(plan.lanes.size(), 1u);
  ASSERT_EQ(plan.lanes[0].size(), 3u);
  EXPECT_EQ(plan.merged_ops, 2u);
  EXPECT_EQ(plan.lanes[0][0].local_region, 3u);
  EXPECT_EQ(plan.lanes[0][1].local_region, 3u);
  EXPECT_EQ(plan.lanes[0][1].local, At(local, 4096));
  EXPECT_EQ(plan.lanes[0][2].local_region, 4u);
}

TEST(OpPlannerTest, DoesNotMergeAcrossRegionsOrLocalGaps) {
  std::vector<std::byte> local(1 << 20);
  std::vector<transport::WireOp> ops = {
      {At(local, 0), 1, 0, 100},
      {At(local, 100), 2, 100, 100},  // other remote region
      {At(local, 300), 1, 100, 100},  // remote contiguous, local not
  };
  Plan plan = PlanOps(ops, PlanLimits{});
  EXPECT_EQ(plan.merged_ops, 3u);
  EXPECT_EQ(Bytes(plan), 300u);
}

TEST(OpPlannerTest, SplitsLongOps) {
  std::vector<std::byte> local(10 << 20);
  PlanLimits limits;
  limits.max_op_bytes = 1 << 20;
  Plan plan = PlanOps({{At(local, 0), 1, 0, (5 << 20) + 10}}, limits);
  ASSERT_EQ(plan.lanes.size(), 1u);
  ASSERT_EQ(plan.lanes[0].size(), 6u);
  EXPECT_EQ(plan.lanes[0][5].length, 10u);
  EXPECT_EQ(plan.lanes[0][5].remote_offset, 5u << 20);
  EXPECT_EQ(plan.lanes[0][5].local, At(local, 5 << 20));
  EXPECT_EQ(plan.pieces, 6u);
}

TEST(OpPlannerTest, StripesBigTransfersOverLanesEvenly) {
  std::vector<std::byte> local(8 << 20);
  PlanLimits limits;
  limits.lanes = 4;
  limits.max_op_bytes = 1 << 20;
  Plan plan = PlanOps({{At(local, 0), 1, 0, 4 << 20}}, limits);
  ASSERT_EQ(plan.lanes.size(), 4u);
  for (const auto& lane : plan.lanes) {
    uint64_t bytes = 0;
    for (const auto& op : lane) bytes += op.length;
    EXPECT_EQ(bytes, 1u << 20);
  }
}

TEST(OpPlannerTest, SmallTransfersStayOnOneLane) {
  std::vector<std::byte> local(1 << 20);
  PlanLimits limits;
  limits.lanes = 4;
  limits.stripe_min_bytes = 256 << 10;
  Plan plan = PlanOps({{At(local, 0), 1, 0, 64 << 10}}, limits);
  EXPECT_EQ(plan.lanes.size(), 1u);
}

TEST(OpPlannerTest, RandomOpListsKeepEveryByteExactlyOnce) {
  std::mt19937_64 rng(42);
  std::vector<std::byte> local(64 << 20);
  for (int round = 0; round < 50; ++round) {
    std::vector<transport::WireOp> ops;
    std::vector<int> covered(local.size() / 512, 0);
    uint64_t offset = 0;
    const int n = 1 + rng() % 200;
    for (int i = 0; i < n && offset < local.size() / 2; ++i) {
      const uint64_t len = 512 * (1 + rng() % 4096);
      if (offset + len > local.size() / 2) break;
      ops.push_back({At(local, offset), 1 + rng() % 3, offset, len});
      offset += len + (rng() % 2) * 512;  // sometimes contiguous, sometimes a gap
    }
    PlanLimits limits;
    limits.lanes = 1 + rng() % 8;
    limits.max_op_bytes = 4096 * (1 + rng() % 512);
    uint64_t expected = 0;
    for (const auto& op : ops) expected += op.length;
    Plan plan = PlanOps(ops, limits);
    EXPECT_EQ(plan.total_bytes, expected);
    EXPECT_LE(plan.lanes.size(), limits.lanes);
    for (const auto& lane : plan.lanes) {
      for (const auto& op : lane) {
        EXPECT_LE(op.length, limits.max_op_bytes);
        // Same mapping as before: local offset == remote offset in this generator.
        EXPECT_EQ(static_cast<uint64_t>(op.local - local.data()), op.remote_offset);
        for (uint64_t b = op.remote_offset / 512; b < (op.remote_offset + op.length) / 512; ++b)
          ++covered[b];
      }
    }
    for (const auto& op : ops)
      for (uint64_t b = op.remote_offset / 512; b < (op.remote_offset + op.length) / 512; ++b)
        EXPECT_EQ(covered[b], 1) << "block " << b;
  }
}

// The plan of a page list (shuffled runs of consecutive pages, some runs broken locally, in
// two regions, sorted or not) is the one of sorting every op and merging left to right; a
// sorted list skips the sort and must give the same.
// Random page lists against the reference "sort every op, then merge": pages 0..n-1 of
// 4 KiB over `regions` remote regions (ids `regions[k]`), at `offset_base` + the page's
// offset in its region.
void ExpectPlansAsSortingEveryOpAndMerging(const std::vector<RegionId>& regions,
                                           uint64_t offset_base, uint64_t seed) {
  std::vector<std::byte> local(1 << 22);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 200; ++round) {
    // Pages 0..n-1 of 4 KiB cut into runs of 1..8 pages.
    const size_t n = 1 + rng() % 300;
    std::vector<std::pair<size_t, size_t>> runs;  // first page, pages
    for (size_t p = 0; p < n;) {
      const size_t len = std::min<size_t>(n - p, 1 + rng() % 8);
      runs.emplace_back(p, len);
      p += len;
    }
    if (round % 4 != 0) std::shuffle(runs.begin(), runs.end(), rng);
    // Local slots in page order with a gap now and then (a page that continues the one
    // before it remotely but not locally); the pages split evenly over the regions in page
    // order. Pages of two runs can continue one another after the sort.
    std::vector<size_t> slot(n);
    for (size_t page = 0, gaps = 0; page < n; ++page) {
      if (rng() % 10 == 0) ++gaps;
      slot[page] = page + gaps;
    }
    const size_t per_region = (n + regions.size() - 1) / regions.size();
    std::vector<transport::WireOp> ops;
    for (const auto& [first, len] : runs) {
      for (size_t k = 0; k < len; ++k) {
        const size_t page = first + k;
        const size_t r = page / per_region;
        ops.push_back({At(local, slot[page] * 4096), regions[r],
                       offset_base + (page - r * per_region) * 4096, 4096, -1, RegionId{1}});
      }
    }
    // The reference: every op sorted, then merged left to right.
    std::vector<transport::WireOp> sorted = ops;
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
      return a.remote_region != b.remote_region ? a.remote_region < b.remote_region
                                                : a.remote_offset < b.remote_offset;
    });
    std::vector<transport::WireOp> expected;
    for (const transport::WireOp& op : sorted) {
      if (!expected.empty()) {
        transport::WireOp& last = expected.back();
        if (last.remote_region == op.remote_region &&
            last.remote_offset + last.length == op.remote_offset &&
            last.local + last.length == op.local) {
          last.length += op.length;
          continue;
        }
      }
      expected.push_back(op);
    }
    PlanLimits limits;
    limits.max_op_bytes = uint64_t{1} << 30;
    Plan plan = PlanOps(ops, limits);
    ASSERT_EQ(plan.lanes.size(), 1u);
    ASSERT_EQ(plan.merged_ops, expected.size()) << "round " << round;
    ASSERT_EQ(plan.lanes[0].size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      const transport::WireOp& got = plan.lanes[0][i];
      ASSERT_EQ(got.local, expected[i].local) << "round " << round << " op " << i;
      ASSERT_EQ(got.remote_region, expected[i].remote_region);
      ASSERT_EQ(got.remote_offset, expected[i].remote_offset);
      ASSERT_EQ(got.length, expected[i].length);
    }
  }
}

TEST(OpPlannerTest, PlansAsSortingEveryOpAndMerging) {
  ExpectPlansAsSortingEveryOpAndMerging({RegionId{1}, RegionId{2}}, 0, 24);
}

// The sort packs (region rank, offset, index) into 8-byte keys: regions with far-apart ids,
// offsets high in a big region, and a region given before a lower one still sort as the ops.
TEST(OpPlannerTest, PlansAsSortingEveryOpAndMergingWithPackedKeys) {
  ExpectPlansAsSortingEveryOpAndMerging({RegionId{1} << 40, RegionId{3}, RegionId{7}},
                                        uint64_t{1} << 40, 25);
}

// Where the keys cannot be packed (more regions than the packed sort ranks, or offsets that
// leave no room for the op's index) the ops themselves are sorted: the same plans.
TEST(OpPlannerTest, PlansAsSortingEveryOpAndMergingWhenKeysDoNotFit) {
  std::vector<RegionId> many;
  for (RegionId r = 20; r > 0; --r) many.push_back(r);
  ExpectPlansAsSortingEveryOpAndMerging(many, 0, 26);
  // An odd offset: no common trailing zero bits to drop, 63 bits of offset.
  ExpectPlansAsSortingEveryOpAndMerging({RegionId{5}, RegionId{4}}, (uint64_t{1} << 62) + 1, 27);
}

TEST(OpPlannerTest, OneBigOpIsStripedEvenWhenNoPieceLimitCutsIt) {
  std::vector<std::byte> local(8 << 20);
  PlanLimits limits;
  limits.lanes = 4;
  limits.max_op_bytes = uint64_t{1} << 30;
  limits.stripe_min_bytes = 256 << 10;
  Plan plan = PlanOps({{At(local, 0), 1, 0, 4 << 20}}, limits);
  ASSERT_EQ(plan.lanes.size(), 4u);
  EXPECT_EQ(plan.pieces, 4u);
  EXPECT_EQ(Bytes(plan), 4u << 20);
}

}  // namespace
}  // namespace kvwire::core
