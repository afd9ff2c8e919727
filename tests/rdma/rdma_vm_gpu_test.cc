// GPU regions over rdma, in the soft-RoCE VM, with the emulated GPU runtime
// (tests/support/emulated_gpu.h) as the process's default runtime. rxe imports no dma-buf
// (and the emulated export is a memfd, not a dma-buf), so ibv_reg_dmabuf_mr is refused and a
// GPU region takes the peer-memory path: ibv_reg_mr on the device pointer, which the emulated
// runtime makes reachable with host_accessible (as nvidia_peermem does for a real GPU) and
// leaves unreachable without it. Device bytes are checked through the runtime, never by
// dereferencing device pointers.
#include <cerrno>
#include <cstring>
#include <dirent.h>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "kvwire/engine.h"
#include "src/gpu/runtime.h"
#include "src/util/log.h"
#include "tests/rdma/rdma_stats.h"
#include "tests/support/emulated_gpu.h"
#include "tests/support/fake_target_hooks.h"
#include "transport/rdma/rdma_transport.h"

namespace kvwire::testing {
namespace {

constexpr uint64_t kAllocationBytes = 1 << 20;
constexpr uint64_t kGpuOffset = 3 * 4096 + 256;  // the region starts inside its allocation
constexpr uint64_t kGpuBytes = 256 << 10;
constexpr uint64_t kHostBytes = 512 << 10;

// Open descriptors other than sockets: what a registration could leak (the exported memfd or
// dma-buf), without the connections the engines (both in this process) open on their own
// schedule, such as a channel's data connection landing between two counts.
int OpenFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (const dirent* e = readdir(d)) {
      char target[256] = {};
      const std::string path = std::string("/proc/self/fd/") + e->d_name;
      const ssize_t len = readlink(path.c_str(), target, sizeof(target) - 1);
      if (len > 0 && std::string(target, static_cast<size_t>(len)).rfind("socket:", 0) == 0) {
        continue;
      }
      ++n;
    }
    closedir(d);
  }
  return n;
}

// The errno text after `call: ` in `text`, if it is one strerror() gives.
bool NamesErrnoOf(const std::string& text, const std::string& call) {
  const size_t at = text.find(call + ": ");
  if (at == std::string::npos) return false;
  const std::string rest = text.substr(at + call.size() + 2);
  for (int e = 1; e < 134; ++e) {
    if (rest.rfind(std::strerror(e), 0) == 0) return true;
  }
  return false;
}

std::vector<std::byte> Pattern(uint64_t bytes, uint8_t seed) {
  std::vector<std::byte> v(bytes);
  for (uint64_t i = 0; i < bytes; ++i) v[i] = static_cast<std::byte>((i * 131 + seed) ^ (i >> 9));
  return v;
}

// Two engines in this process on rxe0 (one runtime for both), forced onto rdma; `a` holds the
// GPU memory.
class RdmaGpuTest : public ::testing::Test {
 protected:
  void Start(EmulatedGpuOptions gpu_options) {
    gpu_ = std::make_unique<EmulatedGpu>(gpu_options);
    gpu::SetDefaultRuntime(&gpu_->runtime());
    EngineOptions base;
    base.transport = "rdma";
    base.rdma().devices = {"rxe0"};
    base.rdma().qps_per_peer = 2;
    base.connect_timeout = absl::Seconds(60);
    base.peer_lease = absl::Seconds(60);
    EngineOptions a_options = base, b_options = base;
    a_options.name = "gpu-a";
    b_options.name = "gpu-b";
    auto a = Engine::Create(a_options);
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(*a);
    auto b = Engine::Create(b_options);
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
    auto alloc = gpu::DeviceBuffer::Allocate(gpu_->runtime(), 0, kAllocationBytes);
    ASSERT_TRUE(alloc.ok()) << alloc.status();
    allocation_ = std::move(*alloc);
    host_ = Pattern(kHostBytes, 7);
    RegionOptions exported;
    exported.export_to_all_peers = true;
    auto host_id = b_->RegisterMemory(host_.data(), host_.size(), exported);
    ASSERT_TRUE(host_id.ok()) << host_id.status();
    host_id_ = *host_id;
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    allocation_ = gpu::DeviceBuffer();
    gpu::SetDefaultRuntime(nullptr);
    gpu_.reset();
  }

  std::byte* GpuRegionBase() const {
    return static_cast<std::byte*>(allocation_.data()) + kGpuOffset;
  }

  absl::StatusOr<RegionId> RegisterGpuRegion() {
    RegionOptions options;
    options.kind = MemoryKind::kGpu;
    options.export_to_all_peers = true;
    return a_->RegisterMemory(GpuRegionBase(), kGpuBytes, options);
  }

  absl::Status Run(Engine& engine, PeerId peer, OpKind kind, const std::vector<Op>& ops) {
    TransferOptions options;
    options.timeout = absl::Seconds(60);
    auto id = engine.Transfer(peer, kind, ops, options);
    if (!id.ok()) return id.status();
    return engine.Wait(*id, absl::Seconds(90));
  }

  std::vector<std::byte> ReadGpu(uint64_t offset, uint64_t bytes) {
    std::vector<std::byte> out(bytes);
    absl::Status s = gpu_->ReadDevice(out.data(), GpuRegionBase() + offset, bytes);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }
  void WriteGpu(uint64_t offset, const std::vector<std::byte>& bytes) {
    absl::Status s = gpu_->WriteDevice(GpuRegionBase() + offset, bytes.data(), bytes.size());
    ASSERT_TRUE(s.ok()) << s;
  }

  std::unique_ptr<EmulatedGpu> gpu_;
  std::unique_ptr<Engine> a_, b_;
  gpu::DeviceBuffer allocation_;
  std::vector<std::byte> host_;
  RegionId host_id_ = 0;
};

TEST_F(RdmaGpuTest, GpuSubRangeRegistersThroughPeerMemoryAndMovesBytesExactly) {
  ASSERT_NO_FATAL_FAILURE(Start({.devices = 1, .host_accessible = true}));
  // Bytes around the region: they must survive every transfer untouched.
  const std::vector<std::byte> guard = Pattern(kAllocationBytes, 99);
  ASSERT_TRUE(gpu_->WriteDevice(allocation_.data(), guard.data(), guard.size()).ok());

  const int fds = OpenFds();
  SetLogLevel(LogLevel::kInfo);  // the transport's line naming the path and the reason
  auto gpu_id = RegisterGpuRegion();
  SetLogLevel(LogLevel::kWarning);
  ASSERT_TRUE(gpu_id.ok()) << gpu_id.status();
  EXPECT_EQ(OpenFds(), fds) << "the refused dma-buf's fd must be closed";
  const RdmaStats stats = RdmaOf(a_->Stats());
  EXPECT_EQ(a_->Stats().gpu.regions, 1u);
  EXPECT_EQ(stats.rdma_peermem_regions, 1u);
  EXPECT_EQ(stats.rdma_dmabuf_regions, 0u);
  EXPECT_TRUE(NamesErrnoOf(stats.rdma_path_reason, "ibv_reg_dmabuf_mr")) << stats.rdma_path_reason;
  EXPECT_NE(stats.rdma_path_reason.find("peer-memory"), std::string::npos)
      << stats.rdma_path_reason;
  std::printf("GPU region path: %s\n", stats.rdma_path_reason.c_str());
  const std::string json = a_->Stats().ToJson();
  EXPECT_NE(json.find("\"rdma_peermem_regions\":1"), std::string::npos) << json;

  auto b_at_a = a_->Connect(b_->address());
  ASSERT_TRUE(b_at_a.ok()) << b_at_a.status();
  ASSERT_TRUE(a_->WaitForRemoteRegion(*b_at_a, host_id_, absl::Seconds(60)).ok());
  EXPECT_NE(a_->Stats().peers[0].transport.find("rdma"), std::string::npos);

  // a initiates, GPU memory local: READ host -> GPU at unaligned offsets, several pieces.
  std::vector<Op> reads = {Op{*gpu_id, 17, host_id_, 4096 + 3, 100000},
                           Op{*gpu_id, 131072, host_id_, 300000, kGpuBytes - 131072}};
  ASSERT_TRUE(Run(*a_, *b_at_a, OpKind::kRead, reads).ok());
  std::vector<std::byte> expect(guard.begin() + kGpuOffset, guard.begin() + kGpuOffset + kGpuBytes);
  for (const Op& op : reads) {
    std::copy(host_.begin() + op.remote_offset, host_.begin() + op.remote_offset + op.length,
              expect.begin() + op.local_offset);
  }
  EXPECT_TRUE(ReadGpu(0, kGpuBytes) == expect) << "READ into GPU memory is not byte-exact";

  // WRITE GPU -> host.
  const std::vector<std::byte> source = Pattern(kGpuBytes, 42);
  WriteGpu(0, source);
  std::vector<Op> writes = {Op{*gpu_id, 5, host_id_, 64, 70000},
                            Op{*gpu_id, 100000, host_id_, 262144, kGpuBytes - 100000}};
  ASSERT_TRUE(Run(*a_, *b_at_a, OpKind::kWrite, writes).ok());
  for (const Op& op : writes) {
    EXPECT_EQ(
        0, std::memcmp(host_.data() + op.remote_offset, source.data() + op.local_offset, op.length))
        << "WRITE from GPU memory is not byte-exact at " << op.local_offset;
  }
  // A WRITE small enough to go inline must not: the CPU cannot read device memory.
  const uint64_t inline_before = RdmaOf(a_->Stats()).inline_wrs;
  ASSERT_TRUE(Run(*a_, *b_at_a, OpKind::kWrite, {Op{*gpu_id, 8, host_id_, 200000, 64}}).ok());
  EXPECT_EQ(RdmaOf(a_->Stats()).inline_wrs, inline_before) << "a WRITE from GPU memory went inline";
  EXPECT_EQ(0, std::memcmp(host_.data() + 200000, source.data() + 8, 64));

  // b initiates, GPU memory remote (a's MR and rkey): WRITE host -> GPU, READ it back.
  auto a_at_b = b_->Connect(a_->address());
  ASSERT_TRUE(a_at_b.ok()) << a_at_b.status();
  ASSERT_TRUE(b_->WaitForRemoteRegion(*a_at_b, *gpu_id, absl::Seconds(60)).ok());
  const std::vector<std::byte> fresh = Pattern(kHostBytes, 3);
  std::copy(fresh.begin(), fresh.end(), host_.begin());
  ASSERT_TRUE(
      Run(*b_, *a_at_b, OpKind::kWrite, {Op{host_id_, 1000, *gpu_id, 333, kGpuBytes - 333}}).ok());
  const std::vector<std::byte> device = ReadGpu(333, kGpuBytes - 333);
  EXPECT_EQ(0, std::memcmp(device.data(), fresh.data() + 1000, device.size()))
      << "remote WRITE into GPU memory is not byte-exact";
  std::fill(host_.begin(), host_.end(), std::byte{0});
  ASSERT_TRUE(Run(*b_, *a_at_b, OpKind::kRead, {Op{host_id_, 0, *gpu_id, 0, kGpuBytes}}).ok());
  EXPECT_TRUE(std::vector<std::byte>(host_.begin(), host_.begin() + kGpuBytes) ==
              ReadGpu(0, kGpuBytes))
      << "remote READ of GPU memory is not byte-exact";

  // Nothing outside the region was touched.
  std::vector<std::byte> all(kAllocationBytes);
  ASSERT_TRUE(gpu_->ReadDevice(all.data(), allocation_.data(), all.size()).ok());
  EXPECT_EQ(0, std::memcmp(all.data(), guard.data(), kGpuOffset));
  EXPECT_EQ(0,
            std::memcmp(all.data() + kGpuOffset + kGpuBytes, guard.data() + kGpuOffset + kGpuBytes,
                        kAllocationBytes - kGpuOffset - kGpuBytes));

  ASSERT_TRUE(b_->Disconnect(*a_at_b).ok());
  ASSERT_TRUE(a_->Disconnect(*b_at_a).ok());
  ASSERT_TRUE(a_->DeregisterMemory(*gpu_id).ok());
  const RdmaStats after = RdmaOf(a_->Stats());
  EXPECT_EQ(a_->Stats().gpu.regions, 0u);
  EXPECT_EQ(after.rdma_peermem_regions, 0u);
}

TEST_F(RdmaGpuTest, UnreachableGpuMemoryFailsNamingBothPathsAndLeaksNothing) {
  ASSERT_NO_FATAL_FAILURE(Start({.devices = 1, .host_accessible = false}));
  const int fds = OpenFds();
  auto gpu_id = RegisterGpuRegion();
  ASSERT_FALSE(gpu_id.ok());
  const std::string m(gpu_id.status().message());
  std::printf("refused: %s\n", gpu_id.status().ToString().c_str());
  EXPECT_NE(m.find("rdma"), std::string::npos) << m;
  EXPECT_NE(m.find("dma-buf path"), std::string::npos) << m;
  EXPECT_TRUE(NamesErrnoOf(m, "ibv_reg_dmabuf_mr")) << m;
  EXPECT_NE(m.find("peer-memory path"), std::string::npos) << m;
  EXPECT_TRUE(NamesErrnoOf(m, "ibv_reg_mr on the device pointer")) << m;
  EXPECT_NE(m.find("rxe0:1"), std::string::npos) << m;
  EXPECT_EQ(OpenFds(), fds) << "a failed registration must close the dma-buf fd";
  const EngineStats stats = a_->Stats();
  EXPECT_EQ(stats.regions, 0u);
  EXPECT_EQ(stats.gpu.regions, 0u);
  EXPECT_EQ(RdmaOf(stats).rdma_peermem_regions + RdmaOf(stats).rdma_dmabuf_regions, 0u);

  // The engine is still usable: host memory registers and moves over rdma.
  std::vector<std::byte> local(64 << 10, std::byte{0});
  auto local_id = a_->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(local_id.ok()) << local_id.status();
  auto b_at_a = a_->Connect(b_->address());
  ASSERT_TRUE(b_at_a.ok()) << b_at_a.status();
  ASSERT_TRUE(a_->WaitForRemoteRegion(*b_at_a, host_id_, absl::Seconds(60)).ok());
  ASSERT_TRUE(
      Run(*a_, *b_at_a, OpKind::kRead, {Op{*local_id, 0, host_id_, 4096, local.size()}}).ok());
  EXPECT_EQ(0, std::memcmp(local.data(), host_.data() + 4096, local.size()));
  // Registering again, now with a peer, fails the same way (nothing half-registered).
  const int connected_fds = OpenFds();
  auto again = RegisterGpuRegion();
  EXPECT_EQ(again.status().code(), gpu_id.status().code()) << again.status();
  EXPECT_EQ(OpenFds(), connected_fds);
  ASSERT_TRUE(a_->Disconnect(*b_at_a).ok());
}

// --- leak check (valgrind, see run_in_vm.sh): both registration outcomes at the transport ---

absl::StatusOr<transport::LocalRegion> GpuLocalRegion(gpu::Runtime& rt, void* base,
                                                      uint64_t length) {
  auto info = rt.QueryPointer(base);
  if (!info.ok()) return info.status();
  transport::LocalRegion r;
  r.id = 1;
  r.base = static_cast<std::byte*>(base);
  r.length = length;
  r.access = kRemoteReadWrite;
  r.kind = MemoryKind::kGpu;
  r.gpu_device = info->device;
  r.gpu_allocation_base = static_cast<std::byte*>(info->allocation_base);
  r.gpu_allocation_size = info->allocation_size;
  return r;
}

TEST(RdmaLeakCheck, GpuRegistrationBothOutcomes) {
  for (bool reachable : {true, false}) {
    EmulatedGpu emulated({.devices = 1, .host_accessible = reachable});
    FakeTargetHooks hooks;  // lets no peer in
    transport::RdmaTransportOptions options;
    options.devices = {"rxe0"};
    options.gpu_runtime = &emulated.runtime();
    auto t = transport::CreateRdmaTransport(options, &hooks);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE((*t)->caps().gpu_memory);
    auto alloc = gpu::DeviceBuffer::Allocate(emulated.runtime(), 0, 64 << 10);
    ASSERT_TRUE(alloc.ok()) << alloc.status();
    auto region = GpuLocalRegion(emulated.runtime(),
                                 static_cast<std::byte*>(alloc->data()) + 4096 + 64, 16 << 10);
    ASSERT_TRUE(region.ok()) << region.status();
    absl::Status s = (*t)->RegisterRegion(*region);
    EngineStats stats = StatsOf(transport::RdmaTransportStats());
    (*t)->AddStats(&stats.transport_stats);
    if (reachable) {
      ASSERT_TRUE(s.ok()) << s;
      // A peer's own MR of the region takes the same (peer-memory) path.
      auto key = (*t)->ExportKey(5, 1);
      ASSERT_TRUE(key.ok()) << key.status();
      EXPECT_FALSE(key->empty());
      EXPECT_EQ(*(*t)->ExportKey(5, 1), *key);
      EXPECT_EQ(RdmaOf(stats).rdma_peermem_regions, 1u);
      (*t)->DeregisterRegion(1);
    } else {
      EXPECT_FALSE(s.ok());
      EXPECT_EQ(RdmaOf(stats).rdma_peermem_regions, 0u);
    }
    (*t)->Shutdown();
  }
}

}  // namespace
}  // namespace kvwire::testing
