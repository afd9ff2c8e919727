// Routing from declared capabilities (src/core/route.h): which channels open to a peer, and
// which transport carries a transfer. The built-ins' declarations are copied here as plain
// structs, so each rule is checked without a socket.
#include "src/core/route.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvwire::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

transport::Capabilities Caps(std::string name, uint32_t rank, bool every_region,
                             bool same_host_only = false) {
  transport::Capabilities c;
  c.name = std::move(name);
  c.rank = rank;
  c.reaches_every_region = every_region;
  c.same_host_only = same_host_only;
  return c;
}

class RouteTest : public ::testing::Test {
 protected:
  // Registration order differs from rank order on purpose (as the engine registers them).
  transport::Capabilities tcp_ = Caps("tcp", 30, true);
  transport::Capabilities shm_ = Caps("shm", 10, false, /*same_host_only=*/true);
  transport::Capabilities rdma_ = Caps("rdma", 20, false);
  std::vector<const transport::Capabilities*> caps_ = {&tcp_, &shm_, &rdma_};
  static constexpr size_t kTcp = 0, kShm = 1, kRdma = 2;
};

TEST_F(RouteTest, RankOrderIsLowestRankFirstAndStable) {
  EXPECT_THAT(RankOrder(caps_), ElementsAre(kShm, kRdma, kTcp));
  transport::Capabilities twin = Caps("twin", 30, true);
  std::vector<const transport::Capabilities*> with_twin = {&twin, &tcp_};
  EXPECT_THAT(RankOrder(with_twin), ElementsAre(0u, 1u));
}

TEST_F(RouteTest, SameHostPeerGetsTheBestPartialTransportAndAFallback) {
  ChannelChoice choice(caps_, "");
  ASSERT_EQ(choice.Next(), kShm);
  choice.Connected(kShm);
  // rdma would reach only some regions too: the fallback that reaches all of them is next.
  ASSERT_EQ(choice.Next(), kTcp);
  choice.Connected(kTcp);
  EXPECT_EQ(choice.Next(), std::nullopt);
  EXPECT_TRUE(choice.Result("p").ok());
  EXPECT_THAT(choice.connected(), ElementsAre(kShm, kTcp));
  EXPECT_EQ(choice.Reason(), "same host");
  EXPECT_EQ(choice.Describe({"tcp x4 a", "shm memfd", ""}),
            "shm memfd; tcp x4 a for regions shm cannot reach");
}

TEST_F(RouteTest, UnusableTransportsAreSkippedWithTheirReasonRecorded) {
  ChannelChoice choice(caps_, "");
  ASSERT_EQ(choice.Next(), kShm);
  choice.Unusable(kShm, "peer on another host");
  ASSERT_EQ(choice.Next(), kRdma);
  choice.Unusable(kRdma, "peer offers no rdma endpoint");
  ASSERT_EQ(choice.Next(), kTcp);
  choice.Connected(kTcp);
  EXPECT_EQ(choice.Next(), std::nullopt);
  EXPECT_EQ(choice.Reason(),
            "tcp ranks first of the usable transports; shm not usable: peer on another host; "
            "rdma not usable: peer offers no rdma endpoint");
  EXPECT_EQ(choice.Describe({"tcp x4 a", "", ""}), "tcp x4 a");
}

TEST_F(RouteTest, ATransportThatReachesEveryRegionEndsTheChoice) {
  transport::Capabilities loop = Caps("loop", 5, true);
  std::vector<const transport::Capabilities*> caps = {&tcp_, &shm_, &rdma_, &loop};
  ChannelChoice choice(caps, "");
  ASSERT_EQ(choice.Next(), 3u);
  choice.Connected(3);
  EXPECT_EQ(choice.Next(), std::nullopt);
  EXPECT_THAT(choice.connected(), ElementsAre(3u));
}

TEST_F(RouteTest, NothingReachableNamesEveryReason) {
  ChannelChoice choice(caps_, "");
  while (auto next = choice.Next()) choice.Unusable(*next, "no");
  const absl::Status s = choice.Result("peer-a");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "no transport reaches peer peer-a: shm: no; rdma: no; tcp: no");
}

TEST_F(RouteTest, ForcedTransportIsTheOnlyOneTried) {
  ChannelChoice choice(caps_, "rdma");
  ASSERT_EQ(choice.Next(), kRdma);
  choice.Connected(kRdma);
  EXPECT_EQ(choice.Next(), std::nullopt);  // no tcp fallback when forced
  EXPECT_TRUE(choice.Result("p").ok());
  EXPECT_EQ(choice.Reason(), "forced by configuration");

  ChannelChoice refused(caps_, "shm");
  ASSERT_EQ(refused.Next(), kShm);
  refused.Unusable(kShm, "peer on another host");
  EXPECT_EQ(refused.Next(), std::nullopt);
  const absl::Status s = refused.Result("p");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "transport shm required but peer p is not reachable over shm: peer on another host");
}

// Read grants: a forced transport whose target cannot check them (shm, rdma) gets the best one
// that can as a fallback, routed only for grant-guarded regions; READs of such regions go only
// to a transport that checks grants.
TEST_F(RouteTest, ForcedTransportGetsAGrantCheckingFallbackForGuardedRegionsOnly) {
  tcp_.checks_grants = true;
  ChannelChoice choice(caps_, "rdma");
  ASSERT_EQ(choice.Next(), kRdma);
  choice.Connected(kRdma);
  ASSERT_EQ(choice.Next(), kTcp);
  choice.Connected(kTcp);
  EXPECT_EQ(choice.Next(), std::nullopt);
  EXPECT_TRUE(choice.Result("p").ok());
  EXPECT_EQ(choice.GrantFallback(), kTcp);
  EXPECT_EQ(choice.Describe({"tcp x4 a", "", "rdma x2"}),
            "rdma x2; tcp x4 a for grant-guarded regions only");
  // Forced tcp checks grants itself: nothing more.
  ChannelChoice tcp_only(caps_, "tcp");
  ASSERT_EQ(tcp_only.Next(), kTcp);
  tcp_only.Connected(kTcp);
  EXPECT_EQ(tcp_only.Next(), std::nullopt);
  EXPECT_EQ(tcp_only.GrantFallback(), std::nullopt);

  const TransportMask connected = TransportMask{1} << kRdma | TransportMask{1} << kTcp;
  TransferNeeds needs;
  needs.kind = OpKind::kWrite;
  needs.local_host = true;
  needs.guarded_only = TransportMask{1} << kTcp;
  needs.reaches = TransportMask{1} << kRdma;
  EXPECT_EQ(*PickTransport(caps_, connected, needs, "p"), kRdma);
  needs.reaches = 0;  // rdma cannot reach it, and tcp is only for guarded regions
  const absl::StatusOr<size_t> refused = PickTransport(caps_, connected, needs, "p");
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("only for grant-guarded regions"));
  needs.guarded = true;
  EXPECT_EQ(*PickTransport(caps_, connected, needs, "p"), kTcp);
  // A READ of a guarded region: never rdma (its target cannot check the grant).
  needs.kind = OpKind::kRead;
  needs.grant_reads = true;
  needs.reaches = TransportMask{1} << kRdma;
  EXPECT_EQ(*PickTransport(caps_, connected, needs, "p"), kTcp);
  const absl::StatusOr<size_t> no_tcp = PickTransport(caps_, TransportMask{1} << kRdma, needs, "p");
  EXPECT_THAT(no_tcp.status().message(), HasSubstr("does not check read grants"));
}

// A forced transport that checks grants but reaches regions one by one (shm serves the ops of
// grant-guarded host regions itself, not those it cannot: GPU memory, checksums) still gets
// the fallback, which must reach every region: the best one that checks grants for all (tcp),
// not another per-region one.
TEST_F(RouteTest, ForcedPerRegionGrantCheckerGetsAFallbackThatReachesEveryRegion) {
  tcp_.checks_grants = true;
  shm_.checks_grants = true;
  rdma_.checks_grants = true;  // per-region too
  ChannelChoice shm(caps_, "shm");
  ASSERT_EQ(shm.Next(), kShm);
  shm.Connected(kShm);
  ASSERT_EQ(shm.Next(), kTcp);
  shm.Connected(kTcp);
  EXPECT_EQ(shm.Next(), std::nullopt);
  EXPECT_EQ(shm.GrantFallback(), kTcp);
  // A guarded READ goes over shm where shm took the region, else over tcp.
  const TransportMask connected = TransportMask{1} << kShm | TransportMask{1} << kTcp;
  TransferNeeds needs;
  needs.kind = OpKind::kRead;
  needs.local_host = true;
  needs.grant_reads = true;
  needs.guarded = true;
  needs.guarded_only = TransportMask{1} << kTcp;
  needs.reaches = TransportMask{1} << kShm;
  EXPECT_EQ(*PickTransport(caps_, connected, needs, "p"), kShm);
  needs.reaches = 0;
  EXPECT_EQ(*PickTransport(caps_, connected, needs, "p"), kTcp);
}

TEST_F(RouteTest, ForcedTransportThisEngineLacksIsRefusedByName) {
  std::vector<const transport::Capabilities*> caps = {&tcp_, &shm_};
  ChannelChoice choice(caps, "rdma");
  EXPECT_EQ(choice.Next(), std::nullopt);
  EXPECT_THAT(choice.Result("p").message(), HasSubstr("this engine has no rdma transport"));
}

TEST_F(RouteTest, TransferTakesTheBestTransportThatReachesEveryRegion) {
  const TransportMask all = 0b111;
  TransferNeeds needs;
  needs.kind = OpKind::kRead;
  needs.local_host = true;
  needs.reaches = TransportMask{1} << kShm | TransportMask{1} << kRdma;
  EXPECT_EQ(*PickTransport(caps_, all, needs, "p"), kShm);
  needs.reaches = TransportMask{1} << kRdma;  // a region shm cannot map
  EXPECT_EQ(*PickTransport(caps_, all, needs, "p"), kRdma);
  needs.reaches = 0;
  EXPECT_EQ(*PickTransport(caps_, all, needs, "p"), kTcp);
  // A channel that is not open is never picked.
  needs.reaches = TransportMask{1} << kShm;
  EXPECT_EQ(*PickTransport(caps_, TransportMask{1} << kTcp, needs, "p"), kTcp);
}

TEST_F(RouteTest, TransferRespectsOpKindAndLocalMemoryKind) {
  shm_.one_sided_write = false;
  tcp_.gpu_memory = true;
  TransferNeeds needs;
  needs.kind = OpKind::kWrite;
  needs.local_host = true;
  needs.reaches = TransportMask{1} << kShm;
  EXPECT_EQ(*PickTransport(caps_, 0b111, needs, "p"), kTcp);
  needs.kind = OpKind::kRead;
  needs.local_gpu = true;  // shm here cannot move GPU memory, tcp can
  EXPECT_EQ(*PickTransport(caps_, 0b111, needs, "p"), kTcp);
  needs.local_host = false;
  tcp_.gpu_memory = false;
  const absl::StatusOr<size_t> none = PickTransport(caps_, 0b111, needs, "peer-b");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(none.status().message(),
            "transfer: no transport to peer peer-b can carry it: shm cannot move GPU memory (a "
            "local region is GPU memory); rdma does not reach every remote region of this "
            "transfer; tcp cannot move GPU memory (a local region is GPU memory)");
}

TEST_F(RouteTest, TransferOverOnlyAPartialTransportNamesWhy) {
  TransferNeeds needs;
  needs.kind = OpKind::kRead;
  needs.local_host = true;
  const absl::StatusOr<size_t> none = PickTransport(caps_, TransportMask{1} << kShm, needs, "p");
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(),
              HasSubstr("shm does not reach every remote region of this transfer"));
  EXPECT_THAT(PickTransport(caps_, 0, needs, "p").status().message(),
              HasSubstr("no data path is open"));
}

}  // namespace
}  // namespace kvwire::core
