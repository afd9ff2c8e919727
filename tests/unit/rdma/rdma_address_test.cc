// Address-vector selection of the rdma transport with synthetic port attributes: RoCE always
// global (GRH, GID index), InfiniBand by LID (a GRH only across subnets), path MTU, and the
// errors for peers that cannot be addressed.
#include "transport/rdma/rdma_address.h"

#include <cstring>

#include <gtest/gtest.h>

namespace kvwire::transport::rdma {
namespace {

ibv_gid Gid(uint64_t prefix, uint64_t guid) {
  ibv_gid g{};
  for (int i = 0; i < 8; ++i) {
    g.raw[i] = static_cast<uint8_t>(prefix >> (56 - 8 * i));
    g.raw[8 + i] = static_cast<uint8_t>(guid >> (56 - 8 * i));
  }
  return g;
}

std::string Bytes(const ibv_gid& g) {
  return std::string(reinterpret_cast<const char*>(g.raw), 16);
}

PortAddress IbPort(uint16_t lid, const ibv_gid& gid) {
  PortAddress p;
  p.where = "mlx5_0:1";
  p.port = 1;
  p.ethernet = false;
  p.gid_index = 0;
  p.gid = gid;
  p.lid = lid;
  p.active_mtu = IBV_MTU_4096;
  return p;
}

pb::RdmaDevice IbPeer(uint32_t lid, const ibv_gid& gid) {
  pb::RdmaDevice d;
  d.set_name("mlx5_3");
  d.set_port(1);
  d.set_ethernet(false);
  d.set_lid(lid);
  d.set_gid(Bytes(gid));
  d.set_mtu(IBV_MTU_4096);
  return d;
}

constexpr uint64_t kSubnet = 0xfe80000000000000ull;

TEST(RdmaAddressTest, InfinibandSameSubnetUsesTheLidWithoutGrh) {
  auto ah = RemoteAddress(IbPort(7, Gid(kSubnet, 0x1111)), IbPeer(42, Gid(kSubnet, 0x2222)));
  ASSERT_TRUE(ah.ok()) << ah.status();
  EXPECT_EQ(ah->dlid, 42);
  EXPECT_EQ(ah->is_global, 0);
  EXPECT_EQ(ah->port_num, 1);
  EXPECT_EQ(ah->sl, 0);
}

TEST(RdmaAddressTest, InfinibandPeerWithoutGidIsReachedByLid) {
  pb::RdmaDevice peer = IbPeer(42, Gid(0, 0));
  peer.clear_gid();
  auto ah = RemoteAddress(IbPort(7, Gid(kSubnet, 1)), peer);
  ASSERT_TRUE(ah.ok()) << ah.status();
  EXPECT_EQ(ah->dlid, 42);
  EXPECT_EQ(ah->is_global, 0);
}

TEST(RdmaAddressTest, InfinibandAcrossSubnetsAddsAGrh) {
  const ibv_gid remote = Gid(0xfec0000000000001ull, 0x2222);
  auto ah = RemoteAddress(IbPort(7, Gid(kSubnet, 0x1111)), IbPeer(42, remote));
  ASSERT_TRUE(ah.ok()) << ah.status();
  EXPECT_EQ(ah->dlid, 42);
  EXPECT_EQ(ah->is_global, 1);
  EXPECT_EQ(0, std::memcmp(ah->grh.dgid.raw, remote.raw, 16));
  EXPECT_EQ(ah->grh.sgid_index, 0);
  EXPECT_GT(ah->grh.hop_limit, 1);
}

TEST(RdmaAddressTest, InfinibandPeerWithoutUnicastLidIsRefused) {
  for (uint32_t lid : {0u, 0xC000u, 0xFFFFu}) {
    auto ah = RemoteAddress(IbPort(7, Gid(kSubnet, 1)), IbPeer(lid, Gid(kSubnet, 2)));
    ASSERT_FALSE(ah.ok()) << lid;
    EXPECT_EQ(ah.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(ah.status().message().find("mlx5_3:1"), std::string::npos) << ah.status();
    EXPECT_NE(ah.status().message().find("subnet manager"), std::string::npos) << ah.status();
  }
}

TEST(RdmaAddressTest, RoceIsAlwaysGlobalWithTheChosenGidIndex) {
  PortAddress local;
  local.where = "rxe0:1";
  local.ethernet = true;
  local.gid_index = 3;
  local.gid = Gid(0, 0x0000ffff0a000001ull);  // ::ffff:10.0.0.1
  local.lid = 0;
  pb::RdmaDevice peer;
  peer.set_name("rxe1");
  peer.set_port(1);
  peer.set_ethernet(true);
  const ibv_gid remote = Gid(0, 0x0000ffff0a000102ull);
  peer.set_gid(Bytes(remote));
  peer.set_lid(0);  // RoCE ports have none; it must not matter
  auto ah = RemoteAddress(local, peer);
  ASSERT_TRUE(ah.ok()) << ah.status();
  EXPECT_EQ(ah->is_global, 1);
  EXPECT_EQ(ah->grh.sgid_index, 3);
  EXPECT_EQ(0, std::memcmp(ah->grh.dgid.raw, remote.raw, 16));
  EXPECT_EQ(ah->dlid, 0);
}

TEST(RdmaAddressTest, RocePeerWithoutGidIsRefused) {
  PortAddress local;
  local.where = "rxe0:1";
  local.ethernet = true;
  pb::RdmaDevice peer;
  peer.set_name("rxe9");
  peer.set_port(1);
  peer.set_ethernet(true);
  for (const std::string& gid : {std::string(), std::string(16, '\0'), std::string(4, 'x')}) {
    peer.set_gid(gid);
    auto ah = RemoteAddress(local, peer);
    ASSERT_FALSE(ah.ok());
    EXPECT_NE(ah.status().message().find("rxe9:1"), std::string::npos) << ah.status();
  }
}

TEST(RdmaAddressTest, LinkLayerMismatchNamesBothPorts) {
  PortAddress local = IbPort(7, Gid(kSubnet, 1));
  pb::RdmaDevice peer = IbPeer(42, Gid(kSubnet, 2));
  peer.set_ethernet(true);
  auto ah = RemoteAddress(local, peer);
  ASSERT_FALSE(ah.ok());
  EXPECT_EQ(ah.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(ah.status().message().find("mlx5_0:1 is InfiniBand"), std::string::npos) << ah.status();
  EXPECT_NE(ah.status().message().find("mlx5_3:1 is RoCE"), std::string::npos) << ah.status();
}

TEST(RdmaAddressTest, PathMtuIsTheSmallerOfBothAndClamped) {
  EXPECT_EQ(PathMtu(IBV_MTU_4096, IBV_MTU_1024), IBV_MTU_1024);
  EXPECT_EQ(PathMtu(IBV_MTU_2048, IBV_MTU_4096), IBV_MTU_2048);
  EXPECT_EQ(PathMtu(IBV_MTU_4096, 0), IBV_MTU_256);    // unset by the peer
  EXPECT_EQ(PathMtu(IBV_MTU_4096, 99), IBV_MTU_4096);  // garbage clamps to the largest
}

}  // namespace
}  // namespace kvwire::transport::rdma
