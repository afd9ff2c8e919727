// The GPU runtime shim against the real runtimes. Every backend compiled into this program is
// tested; where a runtime has no device the device tests skip with its one-line reason, and the
// tests that hold without a device (errors, the reason line itself, handle checks) still run.
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <signal.h>
#include <spawn.h>
#include <thread>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

#include "src/gpu/kv_record_cpu.h"
#include "src/gpu/runtime.h"
#include "tests/unit/gpu/gpu_test_util.h"

extern char** environ;

namespace kvwire::gpu {

// Test names carry the backend's name (found by argument-dependent lookup, so it lives here).
void PrintTo(Backend b, std::ostream* os) { *os << BackendName(b); }

namespace {

using testing::GpuRuntimes;
using testing::Pattern;

// --- none ------------------------------------------------------------------------------------

TEST(NoneRuntime, EveryCallFailsWithOneLineReason) {
  Runtime& rt = NoneRuntime();
  EXPECT_EQ(rt.backend(), Backend::kNone);
  absl::StatusOr<int> n = rt.DeviceCount();
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kUnavailable);
  const std::string why(n.status().message());
  EXPECT_TRUE(absl::StartsWith(why, "kvwire gpu: no GPU runtime in this build (")) << why;
  EXPECT_EQ(why.find('\n'), std::string::npos);

  auto expect_fails = [&](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_EQ(s.message(), why);
  };
  expect_fails(DeviceBuffer::Allocate(rt, 0, 4096).status());
  expect_fails(Stream::Create(rt, 0).status());
  expect_fails(Event::Create(rt, 0).status());
  expect_fails(rt.GetDeviceInfo(0).status());
  expect_fails(rt.ExportIpc(0, nullptr).status());
  char host[16];
  expect_fails(DmaBuf::Export(rt, 0, host, sizeof host).status());
  IpcHandle none_handle;
  expect_fails(IpcMapping::Open(rt, 0, none_handle).status());
  expect_fails(rt.EncodeKvRecords(0, KvEncodeArgs{}, nullptr));
}

TEST(NoneRuntime, EmptyRaiiObjectsRefuseWork) {
  Stream stream;
  Event event;
  char buf[8] = {};
  EXPECT_EQ(stream.Copy(buf, buf, sizeof buf).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stream.Wait(event).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(event.Record(stream).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(event.Done().status().code(), absl::StatusCode::kFailedPrecondition);
  DeviceBuffer moved_from;
  EXPECT_EQ(moved_from.data(), nullptr);
}

TEST(DefaultRuntime, IsTheConfiguredBackend) {
  EXPECT_STREQ(BackendName(DefaultRuntime().backend()), KVWIRE_GPU_DEFAULT_BACKEND);
}

// --- PCI / NUMA helpers ------------------------------------------------------------------------

TEST(Pci, BusIdsAreNormalisedToTheSysfsName) {
  EXPECT_EQ(NormalizePciBusId("0000:3B:00.0"), "0000:3b:00.0");
  EXPECT_EQ(NormalizePciBusId("3b:00.0"), "0000:3b:00.0");
  EXPECT_EQ(NormalizePciBusId("00000000:C1:00.0\n"), "0000:c1:00.0");
  EXPECT_EQ(NormalizePciBusId("0001:3b:00.1"), "0001:3b:00.1");
  EXPECT_EQ(NormalizePciBusId("0000:3b:00"), "");
  EXPECT_EQ(NormalizePciBusId("0000:3g:00.0"), "");
  EXPECT_EQ(NormalizePciBusId(""), "");
}

TEST(Pci, NumaNodeComesFromSysfs) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / absl::StrCat("kvwire-gpu-sysfs-", getpid());
  fs::create_directories(root / "bus/pci/devices/0000:3b:00.0");
  fs::create_directories(root / "bus/pci/devices/0000:3c:00.0");
  std::ofstream(root / "bus/pci/devices/0000:3b:00.0/numa_node") << "1\n";
  std::ofstream(root / "bus/pci/devices/0000:3c:00.0/numa_node") << "-1\n";
  EXPECT_EQ(NumaNodeOfPciDevice("0000:3B:00.0", root.string()), 1);
  EXPECT_EQ(NumaNodeOfPciDevice("0000:3c:00.0", root.string()), -1);
  EXPECT_EQ(NumaNodeOfPciDevice("0000:3d:00.0", root.string()), -1);  // no such device
  EXPECT_EQ(NumaNodeOfPciDevice("garbage", root.string()), -1);
  fs::remove_all(root);
  // And this machine's real PCI devices, where it has any: the same number sysfs shows.
  std::error_code ec;
  for (const auto& dev : fs::directory_iterator("/sys/bus/pci/devices", ec)) {
    int want = -1;
    std::ifstream(dev.path() / "numa_node") >> want;
    EXPECT_EQ(NumaNodeOfPciDevice(dev.path().filename().string()), want < 0 ? -1 : want);
  }
}

// --- GPU backends ------------------------------------------------------------------------------

class GpuRuntimeTest : public ::testing::TestWithParam<Backend> {
 protected:
  Runtime& rt() { return *testing::RuntimeByName(BackendName(GetParam())); }
  std::string NoDevicePrefix() {
    return absl::StrCat("kvwire gpu: no ", rt().backend() == Backend::kCuda ? "CUDA" : "HIP",
                        " device (");
  }
};

// Skips the test, printing the runtime's reason, when it has no device.
#define KVW_REQUIRE_DEVICE()                                     \
  do {                                                           \
    absl::StatusOr<int> count_ = rt().DeviceCount();             \
    if (!count_.ok()) GTEST_SKIP() << count_.status().message(); \
  } while (0)

TEST_P(GpuRuntimeTest, DeviceCountOrOneLineReason) {
  absl::StatusOr<int> n = rt().DeviceCount();
  if (n.ok()) {
    EXPECT_GT(*n, 0);
    return;
  }
  const std::string why(n.status().message());
  std::printf("%s\n", why.c_str());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StartsWith(why, NoDevicePrefix())) << why;
  EXPECT_TRUE(absl::EndsWith(why, ")")) << why;
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
}

TEST_P(GpuRuntimeTest, ErrorsCarryTheRuntimesErrorText) {
  const char* prefix = rt().backend() == Backend::kCuda ? "cuda" : "hip";
  absl::StatusOr<int> n = rt().DeviceCount();
  // Without a device the first call fails; with one, an allocation no GPU has does.
  const size_t bytes = n.ok() ? (size_t{1} << 50) : 4096;
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(rt(), 0, bytes);
  ASSERT_FALSE(buf.ok());
  const std::string msg(buf.status().message());
  EXPECT_TRUE(absl::StartsWith(msg, "kvwire gpu: ")) << msg;
  EXPECT_TRUE(absl::StrContains(msg, prefix)) << msg;   // the call that failed
  EXPECT_TRUE(absl::StrContains(msg, "Error")) << msg;  // the runtime's error name
  if (n.ok()) {
    EXPECT_EQ(buf.status().code(), absl::StatusCode::kResourceExhausted) << msg;
  }
}

TEST_P(GpuRuntimeTest, IpcHandleOfAnotherBackendIsRefused) {
  IpcHandle foreign;
  foreign.backend = rt().backend() == Backend::kCuda ? Backend::kHip : Backend::kCuda;
  absl::StatusOr<IpcMapping> m = IpcMapping::Open(rt(), 0, foreign);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
}

TEST_P(GpuRuntimeTest, DeviceInfo) {
  KVW_REQUIRE_DEVICE();
  absl::StatusOr<DeviceInfo> info = rt().GetDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->ordinal, 0);
  EXPECT_FALSE(info->name.empty());
  EXPECT_GT(info->total_bytes, 0u);
  EXPECT_EQ(NormalizePciBusId(info->pci_bus_id), info->pci_bus_id) << info->pci_bus_id;
  EXPECT_FALSE(info->pci_bus_id.empty());
  EXPECT_GE(info->numa_node, -1);
  std::printf("device 0: %s, %s, NUMA node %d, %.1f GiB, dma-buf %s\n", info->name.c_str(),
              info->pci_bus_id.c_str(), info->numa_node, info->total_bytes / 1073741824.0,
              info->dma_buf ? "yes" : "no");
}

TEST_P(GpuRuntimeTest, CopiesInEveryDirection) {
  KVW_REQUIRE_DEVICE();
  for (size_t bytes : {size_t{1}, size_t{4099}, size_t{8} << 20}) {
    absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(rt(), 0, bytes);
    absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(rt(), 0, bytes);
    absl::StatusOr<Stream> s = Stream::Create(rt(), 0);
    ASSERT_TRUE(a.ok() && b.ok() && s.ok());
    const std::vector<uint8_t> in = Pattern(bytes, 5);
    std::vector<uint8_t> out(bytes, 0);
    ASSERT_TRUE(s->CopyAsync(a->data(), in.data(), bytes).ok());  // H2D
    ASSERT_TRUE(s->CopyAsync(b->data(), a->data(), bytes).ok());  // D2D
    ASSERT_TRUE(s->Copy(out.data(), b->data(), bytes).ok());      // D2H + sync
    EXPECT_EQ(in, out) << bytes << " bytes";
  }
}

TEST_P(GpuRuntimeTest, EventOrdersTwoStreams) {
  KVW_REQUIRE_DEVICE();
  const size_t bytes = 64 << 20;  // long enough that an unordered read would see stale data
  absl::StatusOr<DeviceBuffer> src = DeviceBuffer::Allocate(rt(), 0, bytes);
  absl::StatusOr<DeviceBuffer> dst = DeviceBuffer::Allocate(rt(), 0, bytes);
  absl::StatusOr<Stream> producer = Stream::Create(rt(), 0);
  absl::StatusOr<Stream> consumer = Stream::Create(rt(), 0);
  absl::StatusOr<Event> done = Event::Create(rt(), 0);
  ASSERT_TRUE(src.ok() && dst.ok() && producer.ok() && consumer.ok() && done.ok());
  const std::vector<uint8_t> zeros(bytes, 0), in = Pattern(bytes, 9);
  ASSERT_TRUE(producer->Copy(dst->data(), zeros.data(), bytes).ok());
  ASSERT_TRUE(producer->CopyAsync(src->data(), in.data(), bytes).ok());
  ASSERT_TRUE(producer->CopyAsync(dst->data(), src->data(), bytes).ok());
  ASSERT_TRUE(done->Record(*producer).ok());
  ASSERT_TRUE(consumer->Wait(*done).ok());
  std::vector<uint8_t> out(bytes, 1);
  ASSERT_TRUE(consumer->Copy(out.data(), dst->data(), bytes).ok());
  EXPECT_EQ(out, in);
  absl::StatusOr<bool> finished = done->Done();
  ASSERT_TRUE(finished.ok());
  EXPECT_TRUE(*finished);
  EXPECT_TRUE(done->Synchronize().ok());
}

TEST_P(GpuRuntimeTest, KvRecordKernelMatchesCpuReferenceByteForByte) {
  KVW_REQUIRE_DEVICE();
  const uint32_t block_size = 64, blocks = 40, n = 2000;
  const uint64_t page = KvPageBytes(block_size), cache_bytes = page * blocks;
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> lg(-20.0f, 20.0f);
  std::vector<float> src(size_t{n} * kKvInputDims);
  for (size_t i = 0; i < src.size(); i += kKvTileDims) {
    const float mag = std::exp2(lg(rng));
    for (uint32_t j = 0; j < kKvTileDims; ++j) src[i + j] = normal(rng) * mag;
  }
  src[3] = std::numeric_limits<float>::infinity();  // saturation and NaN paths too
  src[kKvInputDims + 70] = std::numeric_limits<float>::quiet_NaN();
  std::vector<int64_t> slots(block_size * blocks);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(n);
  for (uint32_t i = 0; i < n; i += 97) slots[i] = -1;

  // Token 1 goes to a slot past the cache: the CPU path refuses the batch, the kernel skips
  // that token (no stray write), so the reference below skips it as well.
  slots[1] = static_cast<int64_t>(block_size) * blocks + 5;
  std::vector<uint8_t> want(cache_bytes, 0xcd);
  KvEncodeArgs args;
  args.src = src.data();
  args.slots = slots.data();
  args.cache = want.data();
  args.page_bytes = page;
  args.block_size = block_size;
  args.num_slots = uint64_t{block_size} * blocks;
  args.num_tokens = n;
  ASSERT_EQ(EncodeKvRecordsCpu(args).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int64_t> ref_slots = slots;
  ref_slots[1] = -1;
  KvEncodeArgs ref = args;
  ref.slots = ref_slots.data();
  ASSERT_TRUE(EncodeKvRecordsCpu(ref).ok());

  absl::StatusOr<DeviceBuffer> d_src = DeviceBuffer::Allocate(rt(), 0, src.size() * 4);
  absl::StatusOr<DeviceBuffer> d_slots = DeviceBuffer::Allocate(rt(), 0, slots.size() * 8);
  absl::StatusOr<DeviceBuffer> d_cache = DeviceBuffer::Allocate(rt(), 0, cache_bytes);
  absl::StatusOr<Stream> s = Stream::Create(rt(), 0);
  ASSERT_TRUE(d_src.ok() && d_slots.ok() && d_cache.ok() && s.ok());
  const std::vector<uint8_t> fill(cache_bytes, 0xcd);
  ASSERT_TRUE(s->CopyAsync(d_src->data(), src.data(), src.size() * 4).ok());
  ASSERT_TRUE(s->CopyAsync(d_slots->data(), slots.data(), slots.size() * 8).ok());
  ASSERT_TRUE(s->CopyAsync(d_cache->data(), fill.data(), cache_bytes).ok());
  KvEncodeArgs dargs = args;
  dargs.src = static_cast<const float*>(d_src->data());
  dargs.slots = static_cast<const int64_t*>(d_slots->data());
  dargs.cache = static_cast<uint8_t*>(d_cache->data());
  ASSERT_TRUE(s->EncodeKvRecords(dargs).ok());
  std::vector<uint8_t> got(cache_bytes, 0);
  ASSERT_TRUE(s->Copy(got.data(), d_cache->data(), cache_bytes).ok());
  for (uint64_t i = 0; i < cache_bytes; ++i) {
    ASSERT_EQ(got[i], want[i]) << "first difference at byte " << i << " (page " << i / page
                               << ", offset " << i % page << ")";
  }
}

TEST_P(GpuRuntimeTest, IpcMappingInAnotherProcess) {
  KVW_REQUIRE_DEVICE();
  const size_t bytes = (4 << 20) + 123;
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(rt(), 0, bytes);
  absl::StatusOr<Stream> s = Stream::Create(rt(), 0);
  ASSERT_TRUE(buf.ok() && s.ok());
  const std::vector<uint8_t> in = Pattern(bytes, 21);
  ASSERT_TRUE(s->Copy(buf->data(), in.data(), bytes).ok());
  absl::StatusOr<IpcHandle> h = rt().ExportIpc(0, buf->data());
  ASSERT_TRUE(h.ok()) << h.status();
  std::string hex;
  for (uint8_t b : h->bytes) absl::StrAppend(&hex, absl::Hex(b, absl::kZeroPad2));

  // The peer program, or the command in KVWIRE_GPU_IPC_PEER (words split at spaces; the
  // bundle of perf/gpu-check.sh starts it through its own loader).
  const char* peer = std::getenv("KVWIRE_GPU_IPC_PEER");
  std::vector<std::string> args =
      absl::StrSplit(peer ? peer : KVWIRE_GPU_IPC_PEER, ' ', absl::SkipEmpty());
  for (std::string a : {std::string(BackendName(rt().backend())), std::string("0"), hex,
                        std::to_string(bytes), std::string("21"), std::string("22")}) {
    args.push_back(a);
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ), 0) << argv[0];
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL() << "gpu_ipc_peer did not finish within 60 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "peer status " << status;
  std::vector<uint8_t> out(bytes);
  ASSERT_TRUE(s->Copy(out.data(), buf->data(), bytes).ok());
  EXPECT_EQ(out, Pattern(bytes, 22)) << "the peer's writes are not visible here";
}

TEST_P(GpuRuntimeTest, DmaBufOfSubRangeKeepsItsOffset) {
  KVW_REQUIRE_DEVICE();
  absl::StatusOr<DeviceInfo> info = rt().GetDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  const size_t bytes = 8 << 20, offset = (1 << 20) + 4096, len = 2 << 20;
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(rt(), 0, bytes);
  ASSERT_TRUE(buf.ok());
  void* sub = static_cast<uint8_t*>(buf->data()) + offset;
  absl::StatusOr<DmaBuf> dmabuf = DmaBuf::Export(rt(), 0, sub, len);
  if (!info->dma_buf) {
    ASSERT_FALSE(dmabuf.ok());
    GTEST_SKIP() << "no dma-buf export on this device/runtime: " << dmabuf.status().message();
  }
  ASSERT_TRUE(dmabuf.ok()) << dmabuf.status();
  const DmaBufRange& r = dmabuf->range();
  EXPECT_GE(fcntl(r.fd, F_GETFD), 0);
  // The exported range starts at or below the allocation and holds the sub-range at `offset`.
  EXPECT_GE(r.offset, offset);
  EXPECT_LE(r.offset + len, r.size);
  const off_t end = lseek(r.fd, 0, SEEK_END);
  if (end > 0) {
    EXPECT_EQ(static_cast<uint64_t>(end), r.size);
  }
}

std::vector<Backend> Backends() {
  std::vector<Backend> v;
  for (Runtime* rt : GpuRuntimes()) v.push_back(rt->backend());
  return v;
}
std::string BackendParamName(const ::testing::TestParamInfo<Backend>& info) {
  return BackendName(info.param);
}
INSTANTIATE_TEST_SUITE_P(Built, GpuRuntimeTest, ::testing::ValuesIn(Backends()), BackendParamName);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GpuRuntimeTest);

}  // namespace
}  // namespace kvwire::gpu
