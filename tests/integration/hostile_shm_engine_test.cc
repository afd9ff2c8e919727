// What the shm hardening means for an engine's peers (transport-level attacks:
// tests/unit/shm/hostile_shm_test.cc): memory whose memfd cannot be handed out exactly, and
// heap memory without cross-memory attach, is reached over tcp, where the target validates
// every access; the route is reported in the peer's stats, and the bytes arrive exactly.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "kvwire/engine.h"
#include "tests/integration/peer_process.h"
#include "tests/integration/test_pattern.h"

namespace kvwire::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kRegionBytes = 1 << 20;
constexpr uint64_t kSeed = 11;

absl::Status RunOps(Engine& engine, PeerId peer, OpKind kind, const std::vector<Op>& ops) {
  absl::StatusOr<TransferId> id = engine.Transfer(peer, kind, ops);
  if (!id.ok()) return id.status();
  return engine.Wait(*id, absl::Seconds(60));
}

// A peer process with default options and heap regions: no cross-memory attach either way,
// so its regions go over tcp, and the stats say why.
TEST(HostileShmEngineTest, HeapRegionsOfADefaultPeerGoOverTcpAndTheStatsSaySo) {
  absl::StatusOr<std::unique_ptr<PeerProcess>> peer =
      PeerProcess::Start({"--regions=2", absl::StrCat("--region_bytes=", kRegionBytes),
                          "--shareable=0", absl::StrCat("--seed=", kSeed), "--name=heap-peer"});
  ASSERT_TRUE(peer.ok()) << peer.status();
  EngineOptions options;
  options.name = "tester";
  // This side would use cross-memory attach; the peer did not offer it.
  options.shm().cma = true;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<std::byte> local(2 * kRegionBytes, std::byte{0xEE});
  absl::StatusOr<RegionId> local_id = (*engine)->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(local_id.ok()) << local_id.status();
  absl::StatusOr<PeerId> peer_id = (*engine)->Connect((*peer)->address());
  ASSERT_TRUE(peer_id.ok()) << peer_id.status();
  for (RegionId r : (*peer)->regions()) {
    ASSERT_TRUE((*engine)->WaitForRemoteRegion(*peer_id, r, absl::Seconds(10)).ok());
  }
  const std::string route = (*engine)->Stats().peers.at(0).transport;
  std::printf("route to a default peer with heap regions: %s\n", route.c_str());
  EXPECT_THAT(route, HasSubstr("cma refused: the peer does not offer it"));
  EXPECT_THAT(route, HasSubstr("tcp"));
  EXPECT_THAT(route, HasSubstr("for regions shm cannot reach"));

  const RegionId remote = (*peer)->regions()[0];
  ASSERT_TRUE(
      RunOps(**engine, *peer_id, OpKind::kRead, {Op{*local_id, 0, remote, 0, kRegionBytes}}).ok());
  for (uint64_t i = 0; i < kRegionBytes; ++i) {
    ASSERT_EQ(local[i], PatternByte(kSeed, 0, i)) << "byte " << i;
  }
  // The tcp target still validates: past the end is refused there, not silently clipped.
  const absl::Status past =
      RunOps(**engine, *peer_id, OpKind::kRead, {Op{*local_id, 0, remote, kRegionBytes - 8, 16}});
  EXPECT_FALSE(past.ok());
  engine->reset();
  (*peer)->Stop();
}

// A region that is part of a ShareableBuffer: its memfd would expose the rest, so a peer on
// the same host reaches it over tcp, byte-exact, and cannot write it (read-only).
TEST(HostileShmEngineTest, PartOfASharedBufferGoesOverTcpWithItsPermission) {
  EngineOptions target_options;
  target_options.name = "target";
  absl::StatusOr<std::unique_ptr<Engine>> target = Engine::Create(target_options);
  ASSERT_TRUE(target.ok()) << target.status();
  absl::StatusOr<ShareableBuffer> buffer = ShareableBuffer::Create(4 * kRegionBytes, "partial");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  FillPattern(buffer->data(), buffer->size(), kSeed, 5);
  RegionOptions region_options;
  region_options.access = kRemoteRead;
  region_options.export_to_all_peers = true;
  absl::StatusOr<RegionId> part =
      (*target)->RegisterMemory(buffer->data() + kRegionBytes, kRegionBytes, region_options);
  ASSERT_TRUE(part.ok()) << part.status();

  EngineOptions initiator_options;
  initiator_options.name = "initiator";
  absl::StatusOr<std::unique_ptr<Engine>> initiator = Engine::Create(initiator_options);
  ASSERT_TRUE(initiator.ok()) << initiator.status();
  std::vector<std::byte> local(kRegionBytes, std::byte{0});
  absl::StatusOr<RegionId> local_id = (*initiator)->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(local_id.ok()) << local_id.status();
  absl::StatusOr<PeerId> peer = (*initiator)->Connect((*target)->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE((*initiator)->WaitForRemoteRegion(*peer, *part, absl::Seconds(10)).ok());
  std::printf("route to the target: %s\n", (*initiator)->Stats().peers.at(0).transport.c_str());
  EXPECT_THAT((*initiator)->Stats().peers.at(0).transport, HasSubstr("tcp"));

  // The route text names tcp for every same-host peer (the secondary transport); what shows
  // that this region avoided shm is the target serving the op itself: only tcp's target
  // resolves incoming ops (Engine::ResolveIncoming), shm's initiator copies from its mapping.
  const uint64_t served_before = (*target)->Stats().incoming_ops;
  ASSERT_TRUE(
      RunOps(**initiator, *peer, OpKind::kRead, {Op{*local_id, 0, *part, 0, kRegionBytes}}).ok());
  EXPECT_EQ(std::memcmp(local.data(), buffer->data() + kRegionBytes, kRegionBytes), 0);
  EXPECT_GE((*target)->Stats().incoming_ops, served_before + 1)
      << "the target served no op: the region was read over shm, not tcp";
  const absl::Status write =
      RunOps(**initiator, *peer, OpKind::kWrite, {Op{*local_id, 0, *part, 0, 64}});
  EXPECT_EQ(write.code(), absl::StatusCode::kPermissionDenied) << write;
  initiator->reset();
  target->reset();
}

}  // namespace
}  // namespace kvwire::testing
