// RegionRegistry::UnexportFrom: a withdrawn export is refused to that peer at once (tcp and shm
// validate every op against the registry), to that peer only, all or nothing.
#include <vector>

#include <gtest/gtest.h>

#include "src/core/region_registry.h"

namespace kvwire::core {
namespace {

transport::LocalRegion Region(std::vector<std::byte>& buf) {
  transport::LocalRegion r;
  r.base = buf.data();
  r.length = buf.size();
  r.access = kRemoteReadWrite;
  return r;
}

TEST(RegionRegistryUnexportTest, WithdrawnRegionIsRefusedToThatPeerOnly) {
  std::vector<std::byte> buf(4096);
  RegionRegistry registry;
  const RegionId id = registry.Add(Region(buf), /*export_to_all=*/false);
  ASSERT_TRUE(registry.ExportTo(5, {id}).ok());
  ASSERT_TRUE(registry.ExportTo(6, {id}).ok());
  ASSERT_TRUE(registry.UnexportFrom(5, {id}).ok());
  EXPECT_EQ(registry.ResolveForPeer(5, id, 0, 10, OpKind::kRead).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.ExportedRegion(5, id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.ResolveForPeer(6, id, 0, 10, OpKind::kWrite).ok());
  // Withdrawn twice, or never exported: NotFound.
  EXPECT_EQ(registry.UnexportFrom(5, {id}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.UnexportFrom(7, {id}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.UnexportFrom(6, {999}).code(), absl::StatusCode::kNotFound);
  // Exported again after the withdrawal.
  ASSERT_TRUE(registry.ExportTo(5, {id}).ok());
  EXPECT_TRUE(registry.ResolveForPeer(5, id, 0, 10, OpKind::kRead).ok());
}

TEST(RegionRegistryUnexportTest, AllOrNothingAndNotForRegionsExportedToAll) {
  std::vector<std::byte> a(64), b(64);
  RegionRegistry registry;
  const RegionId mine = registry.Add(Region(a), false);
  const RegionId everyone = registry.Add(Region(b), /*export_to_all=*/true);
  ASSERT_TRUE(registry.ExportTo(5, {mine, everyone}).ok());
  absl::Status s = registry.UnexportFrom(5, {mine, everyone});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("exported to all peers"), std::string::npos) << s;
  // Nothing was withdrawn.
  EXPECT_TRUE(registry.ResolveForPeer(5, mine, 0, 1, OpKind::kRead).ok());
  EXPECT_TRUE(registry.ResolveForPeer(5, everyone, 0, 1, OpKind::kRead).ok());
}

}  // namespace
}  // namespace kvwire::core
