// The verbs-independent logic of the rdma transport: immediate encoding, slots, send-queue
// admission, WR planning (merge, SGEs, splitting), chaining with selective signalling, and
// lane striping.
#include "transport/rdma/rdma_plan.h"

#include <arpa/inet.h>

#include <set>

#include <gtest/gtest.h>

namespace kvwire::transport::rdma {
namespace {

TEST(ImmTest, RoundTripsEverySlotAndExtremeCounts) {
  for (uint32_t slot : {0u, 1u, 77u, kSlotsPerQp - 1}) {
    for (uint32_t count : {1u, 2u, 1000u, kMaxCountPerImm}) {
      uint32_t s = 0, c = 0;
      DecodeImm(EncodeImm(slot, count), &s, &c);
      EXPECT_EQ(s, slot);
      EXPECT_EQ(c, count);
    }
  }
}

TEST(SlotPoolTest, HandsOutEachSlotOnceAndReusesReleasedOnes) {
  SlotPool pool(8);
  std::set<uint32_t> seen;
  for (int i = 0; i < 8; ++i) {
    auto s = pool.Acquire();
    ASSERT_TRUE(s.has_value());
    EXPECT_TRUE(seen.insert(*s).second);
  }
  EXPECT_FALSE(pool.Acquire().has_value());
  pool.Release(5);
  EXPECT_EQ(pool.Acquire(), 5u);
}

TEST(SendWindowTest, NeverAdmitsPastDepthAndRetiresInOrder) {
  SendWindow w(16);
  EXPECT_EQ(w.free(), 16u);
  EXPECT_EQ(w.Reserve(10), 0u);
  EXPECT_EQ(w.Reserve(6), 10u);
  EXPECT_EQ(w.free(), 0u);
  EXPECT_EQ(w.Complete(9), 10u);  // one signal retires the unsignalled WRs before it
  EXPECT_EQ(w.free(), 10u);
  EXPECT_EQ(w.Complete(9), 0u);  // duplicate
  EXPECT_EQ(w.Complete(15), 6u);
  EXPECT_EQ(w.free(), 16u);
  EXPECT_EQ(w.completed(), 16u);
}

ResolvedOp Op(uint64_t local, uint64_t remote, uint64_t len, uint32_t lkey = 1, uint32_t rkey = 2) {
  return ResolvedOp{local, lkey, remote, rkey, len};
}

TEST(PlanWrsTest, ContiguousOpsMergeIntoOneSge) {
  std::vector<ResolvedOp> ops = {Op(1000, 5000, 100), Op(1100, 5100, 50), Op(1150, 5150, 10)};
  WrPlan plan;
  PlanWrs(ops.data(), ops.size(), WrLimits{4, 1 << 20}, &plan);
  ASSERT_EQ(plan.wrs.size(), 1u);
  EXPECT_EQ(plan.wrs[0].bytes, 160u);
  ASSERT_EQ(plan.sges.size(), 1u);
  EXPECT_EQ(plan.sges[0].length, 160u);
}

TEST(PlanWrsTest, RemoteContiguousLocalScatteredUsesSgesUpToMaxSge) {
  std::vector<ResolvedOp> ops;
  for (int i = 0; i < 7; ++i) ops.push_back(Op(10000 * (i + 1), 100 * i, 100));
  WrPlan plan;
  PlanWrs(ops.data(), ops.size(), WrLimits{3, 1 << 20}, &plan);
  ASSERT_EQ(plan.wrs.size(), 3u);  // 3 + 3 + 1 SGEs
  EXPECT_EQ(plan.wrs[0].sge_count, 3u);
  EXPECT_EQ(plan.wrs[1].sge_count, 3u);
  EXPECT_EQ(plan.wrs[2].sge_count, 1u);
  EXPECT_EQ(plan.wrs[1].remote_addr, 300u);
  EXPECT_EQ(plan.wrs[2].bytes, 100u);
  EXPECT_EQ(plan.sges.size(), 7u);
}

TEST(PlanWrsTest, DifferentKeysOrGapsStartNewWrs) {
  std::vector<ResolvedOp> ops = {Op(0, 0, 10), Op(10, 10, 10, 1, 9), Op(20, 30, 10),
                                 Op(30, 40, 10, 7, 2)};
  WrPlan plan;
  PlanWrs(ops.data(), ops.size(), WrLimits{4, 1 << 20}, &plan);
  ASSERT_EQ(plan.wrs.size(), 3u);  // rkey change, remote gap; lkey change joins as an SGE
  EXPECT_EQ(plan.wrs[2].sge_count, 2u);
}

TEST(PlanWrsTest, LongOpsAreSplitAtMaxWrBytes) {
  std::vector<ResolvedOp> ops = {Op(0, 0, 2500)};
  WrPlan plan;
  PlanWrs(ops.data(), ops.size(), WrLimits{4, 1000}, &plan);
  ASSERT_EQ(plan.wrs.size(), 3u);
  EXPECT_EQ(plan.wrs[0].bytes, 1000u);
  EXPECT_EQ(plan.wrs[2].bytes, 500u);
  EXPECT_EQ(plan.wrs[2].remote_addr, 2000u);
  EXPECT_EQ(plan.sges[2].addr, 2000u);
}

TEST(FillChainTest, LinksSignalsSelectivelyAndInlinesSmallPayloads) {
  std::vector<ResolvedOp> ops;
  for (int i = 0; i < 10; ++i) ops.push_back(Op(i * 1000, i * 2000, i == 0 ? 8 : 500));
  WrPlan plan;
  PlanWrs(ops.data(), ops.size(), WrLimits{1, 1 << 20}, &plan);
  ASSERT_EQ(plan.wrs.size(), 10u);
  std::vector<ibv_send_wr> wrs(10);
  const uint64_t tag = 3ull << 48;
  const uint32_t signalled = FillChain(plan, 0, 10, IBV_WR_RDMA_WRITE, 64, 4, 100, tag, wrs.data());
  EXPECT_EQ(signalled, 3u);  // 4th, 8th and the last
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(wrs[i].wr_id, tag | (100 + i));
    EXPECT_EQ(wrs[i].next, i < 9 ? &wrs[i + 1] : nullptr);
    EXPECT_EQ((wrs[i].send_flags & IBV_SEND_SIGNALED) != 0, i == 3 || i == 7 || i == 9) << i;
    EXPECT_EQ((wrs[i].send_flags & IBV_SEND_INLINE) != 0, i == 0) << i;
    EXPECT_EQ(wrs[i].wr.rdma.remote_addr, uint64_t(i) * 2000);
  }
  // READs are never inline.
  FillChain(plan, 0, 1, IBV_WR_RDMA_READ, 64, 4, 0, 0, wrs.data());
  EXPECT_EQ(wrs[0].send_flags & IBV_SEND_INLINE, 0);
}

TEST(StripingTest, LanesSpreadOverDevicesThenQps) {
  std::set<std::pair<uint32_t, uint32_t>> used;
  for (uint32_t lane = 0; lane < 8; ++lane) {
    QpAddress a = LaneToQp(lane, 2, 4);
    EXPECT_LT(a.device, 2u);
    EXPECT_LT(a.qp, 4u);
    used.insert({a.device, a.qp});
  }
  EXPECT_EQ(used.size(), 8u);
  EXPECT_EQ(LaneToQp(0, 2, 4).device, 0u);
  EXPECT_EQ(LaneToQp(1, 2, 4).device, 1u);
  EXPECT_EQ(LaneToQp(9, 2, 4).qp, 0u);  // wraps
}

}  // namespace
}  // namespace kvwire::transport::rdma
