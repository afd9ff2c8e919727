// GPU memory over the shm transport between two real processes: this test's engine and
// shm_gpu_peer, both with the emulated GPU runtime installed (device memory is guarded: any CPU
// access to it crashes the process, so every byte must move through the runtime's copies).
// Verification reads device memory through EmulatedGpu::ReadDevice (here) and the peer's FNV
// command (there). One variant slows every device copy, so that a request reported before its
// copies ended would show stale bytes.
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "src/gpu/runtime.h"
#include "tests/integration/peer_process.h"
#include "tests/integration/shm_gpu_layout.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/cma.h"
#include "tests/support/emulated_gpu.h"
#include "tests/support/memfd_mappings.h"

namespace kvwire::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 7;
constexpr uint64_t kLocalBytes = 4 << 20;
constexpr std::byte kPoison{0xEE};

// Mappings of emulated device memory in this process (each allocation or IPC open maps its
// memfd twice): shows whether a peer allocation is still mapped.
int EmulatedMappings() { return MemfdMappings("kvwire-emulated-gpu"); }

struct Piece {
  int region;  // peer region index
  uint64_t remote_offset;
  uint64_t local_offset;
  uint64_t length;
};

// Many small disjoint pieces of peer region 0 and one large piece of region 1, packed one
// after another (with gaps, so that nothing merges) into the local buffer.
std::vector<Piece> MakePieces(std::mt19937_64& rng) {
  std::vector<Piece> pieces;
  uint64_t local = 0;
  // The large piece lies past every small one: both may be mapped to one region.
  const uint64_t large = (1 << 20) + 777;
  const uint64_t large_at = kPeerRegionBytes - large - 4321;
  for (uint64_t at = rng() % 512; pieces.size() < 96;) {
    const uint64_t length = 1 + rng() % 3000;
    if (at + length > large_at) break;
    pieces.push_back(Piece{0, at, local, length});
    at += length + 1 + rng() % 4000;
    local += length + 16;
  }
  pieces.push_back(Piece{1, large_at, local, large});
  std::shuffle(pieces.begin(), pieces.end(), rng);
  return pieces;
}

class ShmGpuTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    emulated_ = std::make_unique<EmulatedGpu>(
        EmulatedGpuOptions{.devices = 1, .copy_delay = absl::Microseconds(GetParam())});
    gpu::SetDefaultRuntime(&emulated_->runtime());
    auto peer = PeerProcess::Start({absl::StrCat("--copy_delay_us=", GetParam()),
                                    absl::StrCat("--seed=", kSeed), "--name=gpu-peer"});
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = std::move(*peer);
    ASSERT_EQ(peer_->regions().size(), static_cast<size_t>(kPeerRegions));
    EngineOptions options;
    options.name = "gpu-tester";
    options.transport = "shm";
    options.shm().cma = true;  // the peer's heap region: staged cross-memory attach (opted in)
    options.peer_lease = absl::Seconds(5);
    options.heartbeat_interval = absl::Milliseconds(200);
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
    auto device = gpu::DeviceBuffer::Allocate(emulated_->runtime(), 0, kLocalBytes);
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = std::move(*device);
    host_.assign(kLocalBytes, kPoison);
    auto gpu_id = engine_->RegisterMemory(device_.data(), kLocalBytes,
                                          RegionOptions{.kind = MemoryKind::kGpu});
    ASSERT_TRUE(gpu_id.ok()) << gpu_id.status();
    local_gpu_ = *gpu_id;
    auto host_id = engine_->RegisterMemory(host_.data(), host_.size());
    ASSERT_TRUE(host_id.ok()) << host_id.status();
    local_host_ = *host_id;
    baseline_mappings_ = EmulatedMappings();
    auto pid = engine_->Connect(peer_->address());
    ASSERT_TRUE(pid.ok()) << pid.status();
    peer_id_ = *pid;
    for (RegionId r : peer_->regions()) {
      ASSERT_TRUE(engine_->WaitForRemoteRegion(peer_id_, r, absl::Seconds(10)).ok());
    }
  }

  void TearDown() override {
    engine_.reset();
    if (peer_) peer_->Stop();
    device_ = gpu::DeviceBuffer();
    emulated_.reset();
  }

  RegionId PeerRegion(int index) const { return peer_->regions()[index]; }

  absl::Status Run(OpKind kind, RegionId local, const std::vector<Piece>& pieces) {
    std::vector<Op> ops;
    for (const Piece& p : pieces) {
      ops.push_back(Op{local, p.local_offset, PeerRegion(p.region), p.remote_offset, p.length});
    }
    auto id = engine_->Transfer(peer_id_, kind, ops);
    if (!id.ok()) return id.status();
    return engine_->Wait(*id, absl::Seconds(60));
  }

  // One command to the peer, and its reply line.
  std::string Ask(const std::string& command) {
    if (absl::Status s = engine_->SendMessage(peer_id_, "gpu-peer", command); !s.ok()) {
      return absl::StrCat("send failed: ", s.ToString());
    }
    absl::StatusOr<std::string> line = peer_->ReadLine(absl::Seconds(30));
    return line.ok() ? *line : line.status().ToString();
  }

  // The peer's region `index` is `expected` (its FNV, computed there from device memory).
  void ExpectPeerRegion(int index, const std::vector<std::byte>& expected) {
    EXPECT_EQ(Ask(absl::StrCat("FNV ", index, " 0 ", kPeerRegionBytes)),
              absl::StrCat("FNV ", Fnv1a(expected.data(), expected.size())))
        << "peer region " << index;
  }

  std::vector<std::byte> LocalGpuBytes() {
    std::vector<std::byte> bytes(kLocalBytes);
    EXPECT_TRUE(emulated_->ReadDevice(bytes.data(), device_.data(), kLocalBytes).ok());
    return bytes;
  }

  void FillLocalGpu(uint64_t seed) {
    std::vector<std::byte> bytes(kLocalBytes);
    FillPattern(bytes.data(), bytes.size(), seed, 9);
    ASSERT_TRUE(emulated_->WriteDevice(device_.data(), bytes.data(), bytes.size()).ok());
  }

  static std::vector<std::byte> PeerPattern(int index) {
    std::vector<std::byte> bytes(kPeerRegionBytes);
    FillPattern(bytes.data(), bytes.size(), kSeed, index);
    return bytes;
  }

  // Each piece of `local` landed at its place in the peer's regions (which held the pattern).
  void ExpectWritten(const std::vector<std::byte>& local, const std::vector<Piece>& pieces,
                     int first_region, int last_region) {
    for (int r = first_region; r <= last_region; ++r) {
      std::vector<std::byte> expected = PeerPattern(r);
      for (const Piece& p : pieces) {
        if (p.region == r) {
          std::memcpy(expected.data() + p.remote_offset, local.data() + p.local_offset, p.length);
        }
      }
      ExpectPeerRegion(r, expected);
    }
  }

  // Each piece of the local buffer holds the peer's pattern at the piece's place.
  static void ExpectRead(const std::vector<std::byte>& local, const std::vector<Piece>& pieces) {
    for (const Piece& p : pieces) {
      for (uint64_t i = 0; i < p.length; ++i) {
        ASSERT_EQ(local[p.local_offset + i], PatternByte(kSeed, p.region, p.remote_offset + i))
            << "region " << p.region << " offset " << p.remote_offset + i;
      }
    }
  }

  std::unique_ptr<EmulatedGpu> emulated_;
  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<Engine> engine_;
  gpu::DeviceBuffer device_;
  std::vector<std::byte> host_;
  RegionId local_gpu_ = 0, local_host_ = 0;
  PeerId peer_id_ = 0;
  int baseline_mappings_ = 0;
};

TEST_P(ShmGpuTest, RouteIsShmAndOneIpcOpenServesBothRegionsOfTheAllocation) {
  EngineStats stats = engine_->Stats();
  ASSERT_EQ(stats.peers.size(), 1u);
  EXPECT_THAT(stats.peers[0].transport, HasSubstr("shm memfd"));
  EXPECT_THAT(stats.peers[0].transport, HasSubstr("+gpu-ipc"));
  // Regions 0 and 1 lie in one device allocation of the peer: one IPC open for both.
  EXPECT_EQ(stats.TransportStatValue("gpu", "shm_ipc_opens"), 1u);
  EXPECT_EQ(emulated_->counters().ipc_opens, 1u);
  EXPECT_EQ(EmulatedMappings(), baseline_mappings_ + 2);
  EXPECT_EQ(stats.gpu.regions, 1u);
}

TEST_P(ShmGpuTest, ReadGpuToGpu) {
  std::mt19937_64 rng(11);
  const std::vector<Piece> pieces = MakePieces(rng);
  FillLocalGpu(3);
  const uint64_t copies_before = engine_->Stats().TransportStatValue("gpu", "shm_device_copies");
  ASSERT_TRUE(Run(OpKind::kRead, local_gpu_, pieces).ok());
  ExpectRead(LocalGpuBytes(), pieces);
  EngineStats stats = engine_->Stats();
  EXPECT_GE(stats.TransportStatValue("gpu", "shm_device_copies") - copies_before, pieces.size());
  EXPECT_EQ(stats.TransportStatValue("gpu", "shm_ipc_opens"), 1u);
  EXPECT_GE(stats.peers[0].bytes_read, (1u << 20));
}

TEST_P(ShmGpuTest, WriteGpuToGpu) {
  std::mt19937_64 rng(12);
  const std::vector<Piece> pieces = MakePieces(rng);
  FillLocalGpu(5);
  ASSERT_TRUE(Run(OpKind::kWrite, local_gpu_, pieces).ok());
  ExpectWritten(LocalGpuBytes(), pieces, 0, 1);
  EXPECT_EQ(engine_->Stats().TransportStatValue("gpu", "shm_ipc_opens"), 1u);
}

TEST_P(ShmGpuTest, ReadGpuToHostAndWriteHostToGpu) {
  std::mt19937_64 rng(13);
  const std::vector<Piece> pieces = MakePieces(rng);
  ASSERT_TRUE(Run(OpKind::kRead, local_host_, pieces).ok());
  ExpectRead(host_, pieces);
  FillPattern(host_.data(), host_.size(), 21, 4);
  std::vector<Piece> back = MakePieces(rng);
  ASSERT_TRUE(Run(OpKind::kWrite, local_host_, back).ok());
  ExpectWritten(host_, back, 0, 1);
}

TEST_P(ShmGpuTest, LocalGpuToAndFromPeerHostMemory) {
  std::mt19937_64 rng(14);
  std::vector<Piece> pieces = MakePieces(rng);
  for (Piece& p : pieces) p.region = 2;  // the peer's memfd host region
  FillLocalGpu(8);
  ASSERT_TRUE(Run(OpKind::kRead, local_gpu_, pieces).ok());
  ExpectRead(LocalGpuBytes(), pieces);
  FillLocalGpu(9);
  std::vector<Piece> back = MakePieces(rng);
  for (Piece& p : back) p.region = 2;
  ASSERT_TRUE(Run(OpKind::kWrite, local_gpu_, back).ok());
  ExpectWritten(LocalGpuBytes(), back, 2, 2);
}

// Cross-memory attach cannot touch device memory: the channel stages through host memory.
TEST_P(ShmGpuTest, LocalGpuToAndFromPeerHeapMemoryOverCrossMemoryAttach) {
  const std::string route = engine_->Stats().peers[0].transport;
  std::mt19937_64 rng(16);
  std::vector<Piece> pieces = MakePieces(rng);
  for (Piece& p : pieces) p.region = 3;  // the peer's heap region
  FillLocalGpu(10);
  const absl::Status read = Run(OpKind::kRead, local_gpu_, pieces);
  // Where the kernel allows cross-memory attach this path is required; only where it
  // refuses (the probe says so, loudly) is the refusal checked instead.
  if (kvwire::testing::CmaHere().allowed) {
    ASSERT_EQ(route.rfind("shm memfd+cma", 0), 0u) << route;
  } else {
    ASSERT_NE(route.find("cma refused"), std::string::npos) << route;
    // Then the heap region is reached over tcp, which cannot move local GPU memory.
    EXPECT_EQ(read.code(), absl::StatusCode::kFailedPrecondition) << read;
    std::printf("cross-memory attach refused on this host (%s): refusal checked\n", route.c_str());
    return;
  }
  ASSERT_TRUE(read.ok()) << read;
  ExpectRead(LocalGpuBytes(), pieces);
  FillLocalGpu(11);
  std::vector<Piece> back = MakePieces(rng);
  for (Piece& p : back) p.region = 3;
  ASSERT_TRUE(Run(OpKind::kWrite, local_gpu_, back).ok());
  ExpectWritten(LocalGpuBytes(), back, 3, 3);
}

TEST_P(ShmGpuTest, RevokedRegionsCloseTheMappingAndReRegisteredOnesReopenIt) {
  std::mt19937_64 rng(15);
  const std::vector<Piece> pieces = MakePieces(rng);
  ASSERT_TRUE(Run(OpKind::kRead, local_gpu_, pieces).ok());
  ASSERT_EQ(EmulatedMappings(), baseline_mappings_ + 2);
  // One region of the allocation gone: the other still uses the mapping.
  ASSERT_EQ(Ask("DEREG 0"), "OK");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto listed = [&](RegionId id) {
    auto regions = engine_->RemoteRegions(peer_id_);
    if (!regions.ok()) return false;
    for (const RemoteRegion& r : *regions) {
      if (r.id == id) return true;
    }
    return false;
  };
  while (listed(PeerRegion(0)) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_FALSE(listed(PeerRegion(0)));
  absl::SleepFor(absl::Milliseconds(100));  // the channel drops regions on the engine's worker
  EXPECT_EQ(EmulatedMappings(), baseline_mappings_ + 2);
  // The last one gone: the mapping is closed.
  ASSERT_EQ(Ask("DEREG 1"), "OK");
  while (EmulatedMappings() != baseline_mappings_ && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(EmulatedMappings(), baseline_mappings_);
  // Registered again: opened again (a stale mapping would have been reused).
  const std::string again = Ask("REREG 1");
  RegionId id = 0;
  ASSERT_TRUE(absl::StartsWith(again, "REGION ") && absl::SimpleAtoi(again.substr(7), &id))
      << again;
  ASSERT_TRUE(engine_->WaitForRemoteRegion(peer_id_, id, absl::Seconds(10)).ok());
  std::vector<Op> ops = {Op{local_gpu_, 0, id, 4096, 65536}};
  auto transfer = engine_->Transfer(peer_id_, OpKind::kRead, ops);
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE(engine_->Wait(*transfer, absl::Seconds(30)).ok());
  ExpectRead(LocalGpuBytes(), {Piece{1, 4096, 0, 65536}});
  EXPECT_EQ(engine_->Stats().TransportStatValue("gpu", "shm_ipc_opens"), 2u);
  EXPECT_EQ(EmulatedMappings(), baseline_mappings_ + 2);
}

INSTANTIATE_TEST_SUITE_P(CopyDelay, ShmGpuTest, ::testing::Values(0, 300),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat(info.param, "us");
                         });

// A process without a GPU runtime of the peer's kind cannot open the peer's IPC handles: the
// shm channel refuses the GPU regions and the engine routes them over tcp (see
// Engine::Impl::ResolveRemoteRegions), where the target serves them only if its tcp transport
// moves GPU memory.
TEST(ShmGpuFallbackTest, GpuRegionOfAnotherRuntimeGoesOverTcp) {
  gpu::SetDefaultRuntime(nullptr);  // this build's runtime: never the emulated one
  auto peer = PeerProcess::Start({"--seed=3", "--name=gpu-peer"});
  ASSERT_TRUE(peer.ok()) << peer.status();
  EngineOptions options;
  options.name = "no-gpu-tester";
  options.transport = "auto";  // shm, and tcp for what shm cannot reach
  auto engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<std::byte> host(1 << 20, kPoison);
  auto local = (*engine)->RegisterMemory(host.data(), host.size());
  ASSERT_TRUE(local.ok()) << local.status();
  auto pid = (*engine)->Connect((*peer)->address());
  ASSERT_TRUE(pid.ok()) << pid.status();
  for (RegionId r : (*peer)->regions()) {
    ASSERT_TRUE((*engine)->WaitForRemoteRegion(*pid, r, absl::Seconds(10)).ok());
  }
  EngineStats stats = (*engine)->Stats();
  EXPECT_EQ(stats.TransportStatValue("gpu", "shm_ipc_opens"), 0u);
  // The host region still goes over shm; the GPU one does not.
  std::vector<Op> host_op = {Op{*local, 0, (*peer)->regions()[2], 0, 4096}};
  auto id = (*engine)->Transfer(*pid, OpKind::kRead, host_op);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE((*engine)->Wait(*id, absl::Seconds(30)).ok());
  for (uint64_t i = 0; i < 4096; ++i) ASSERT_EQ(host[i], PatternByte(3, 2, i));
  std::vector<Op> gpu_op = {Op{*local, 0, (*peer)->regions()[0], 0, 4096}};
  id = (*engine)->Transfer(*pid, OpKind::kRead, gpu_op);
  absl::Status moved = id.ok() ? (*engine)->Wait(*id, absl::Seconds(30)) : id.status();
  std::printf("GPU region of another runtime, read over tcp: %s\n", moved.ToString().c_str());
  if (moved.ok()) {
    // The peer's tcp moves GPU memory (staged): the bytes must be right.
    for (uint64_t i = 0; i < 4096; ++i) ASSERT_EQ(host[i], PatternByte(3, 0, i));
  } else {
    // Refused by the peer's tcp transport (it does not move GPU memory in this build).
    EXPECT_THAT(moved.message(), HasSubstr("tcp target")) << moved;
  }
  EXPECT_EQ((*engine)->Stats().TransportStatValue("gpu", "shm_device_copies"), 0u);
  engine->reset();
  (*peer)->Stop();
}

}  // namespace
}  // namespace kvwire::testing
