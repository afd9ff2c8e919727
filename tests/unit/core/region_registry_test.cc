#include "src/core/region_registry.h"

#include <gtest/gtest.h>

namespace kvwire::core {
namespace {

transport::LocalRegion Region(std::vector<std::byte>& buf, uint32_t access) {
  transport::LocalRegion r;
  r.base = buf.data();
  r.length = buf.size();
  r.access = access;
  return r;
}

TEST(RegionRegistryTest, IncomingOpsAreValidated) {
  std::vector<std::byte> buf(4096);
  RegionRegistry registry;
  const RegionId ro = registry.Add(Region(buf, kRemoteRead), /*export_to_all=*/false);
  const RegionId rw = registry.Add(Region(buf, kRemoteReadWrite), /*export_to_all=*/true);

  // Not exported to peer 5 yet: looks unknown.
  auto s = registry.ResolveForPeer(5, ro, 0, 10, OpKind::kRead);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.ExportTo(5, {ro}).ok());
  EXPECT_TRUE(registry.ResolveForPeer(5, ro, 0, 10, OpKind::kRead).ok());
  // Another peer still cannot.
  EXPECT_FALSE(registry.ResolveForPeer(6, ro, 0, 10, OpKind::kRead).ok());
  // Permission.
  s = registry.ResolveForPeer(5, ro, 0, 10, OpKind::kWrite);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied);
  // Bounds, including overflow.
  s = registry.ResolveForPeer(6, rw, 4000, 97, OpKind::kWrite);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(s.status().message().find("4096"), std::string::npos) << s.status();
  s = registry.ResolveForPeer(6, rw, UINT64_MAX - 5, 10, OpKind::kWrite);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(registry.ResolveForPeer(6, rw, 0, 0, OpKind::kWrite).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto ok = registry.ResolveForPeer(6, rw, 4000, 96, OpKind::kWrite);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->data, buf.data() + 4000);
  // Unknown region.
  EXPECT_EQ(registry.ResolveForPeer(6, 999, 0, 1, OpKind::kRead).status().code(),
            absl::StatusCode::kNotFound);
}

// While the engine registers a region with its transports, no peer reaches it, though it is
// exported to every peer and its id is easy to guess: shm must not hand out a buffer's memfd
// before rdma has pinned it (then it would never be mapped out at all).
TEST(RegionRegistryTest, AnUnpublishedRegionLooksUnexportedToEveryPeer) {
  std::vector<std::byte> buf(4096);
  RegionRegistry registry;
  const RegionId id =
      registry.Add(Region(buf, kRemoteReadWrite), /*export_to_all=*/true, /*published=*/false);
  EXPECT_EQ(registry.ExportedRegion(5, id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.ResolveForPeer(5, id, 0, 10, OpKind::kRead).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.ExportedToAll().empty());
  EXPECT_TRUE(registry.ResolveLocal(id, 0, 10).ok()) << "the engine itself may use it";
  registry.Publish(id);
  EXPECT_TRUE(registry.ExportedRegion(5, id).ok());
  EXPECT_TRUE(registry.ResolveForPeer(5, id, 0, 10, OpKind::kRead).ok());
  EXPECT_EQ(registry.ExportedToAll().size(), 1u);
}

TEST(RegionRegistryTest, PinsOutliveRemoval) {
  std::vector<std::byte> buf(100);
  RegionRegistry registry;
  const RegionId id = registry.Add(Region(buf, kRemoteReadWrite), true);
  auto pinned = registry.ResolveLocal(id, 0, 100);
  ASSERT_TRUE(pinned.ok());
  auto removed = registry.Remove(id);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(removed->use_count(), 2);  // ours + the pin
  EXPECT_FALSE(registry.ResolveLocal(id, 0, 1).ok());
  pinned->pin.reset();
  EXPECT_EQ(removed->use_count(), 1);
  EXPECT_EQ(registry.Remove(id).status().code(), absl::StatusCode::kNotFound);
}

TEST(RegionRegistryTest, IdsAreNeverReused) {
  std::vector<std::byte> buf(100);
  RegionRegistry registry;
  const RegionId a = registry.Add(Region(buf, kRemoteRead), false);
  ASSERT_TRUE(registry.Remove(a).ok());
  EXPECT_NE(registry.Add(Region(buf, kRemoteRead), false), a);
}

}  // namespace
}  // namespace kvwire::core
