// GPU memory over the tcp transport: two engines in this process, talking over loopback tcp
// (several lanes), with the emulated GPU runtime (tests/support/emulated_gpu.h) whose device
// memory the CPU cannot touch (any access faults), so every device byte must go through the
// transport's pinned staging buffers. Bytes are verified through EmulatedGpu::ReadDevice.
// Each test runs without and with a copy delay (late copies expose missing waits).
#include <algorithm>
#include <cstring>
#include <iostream>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "src/gpu/runtime.h"
#include "tests/support/emulated_gpu.h"

namespace kvwire::testing {
namespace {

constexpr std::byte kPoison{0xC3};
constexpr absl::Duration kWait = absl::Seconds(60);
// Big enough for several 1 MiB staging chunks per op and transfer, odd sizes included.
constexpr uint64_t kRegionBytes = 40 << 20;
// The transport's staging chunk (transport/tcp/tcp_staging.h): a cancelled READ's copies are
// whole chunks.
constexpr uint64_t kStagingChunk = 1 << 20;

enum class Where { kHost, kGpu };

const char* Name(Where w) { return w == Where::kHost ? "host" : "gpu"; }

// One side's memory: a host region and a GPU region (device `device`), both registered.
struct Memory {
  std::vector<std::byte> host;
  gpu::DeviceBuffer device;
  RegionId host_id = 0;
  RegionId gpu_id = 0;
};

void Fill(std::vector<std::byte>& bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, 8);
  }
  for (; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(rng());
}

// Index of the first differing byte, or -1.
int64_t FirstDifference(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  if (a.size() != b.size()) return 0;
  if (std::memcmp(a.data(), b.data(), a.size()) == 0) return -1;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

class TcpGpuFixture : public ::testing::Test {
 protected:
  // Installs an emulated GPU whose copies each take `copy_delay` longer, then two engines
  // (initiator: host + GPU 0 memory; target: host + GPU 1 memory, exported) over tcp.
  void Start(absl::Duration copy_delay, uint64_t max_op_bytes = 4 << 20,
             uint64_t region_bytes = kRegionBytes) {
    region_bytes_ = region_bytes;
    emulated_ = std::make_unique<EmulatedGpu>(
        EmulatedGpuOptions{.devices = 2, .host_accessible = false, .copy_delay = copy_delay});
    gpu::SetDefaultRuntime(&emulated_->runtime());
    rt_ = &emulated_->runtime();
    ASSERT_NO_FATAL_FAILURE(StartEngines(max_op_bytes, 0, 1));
  }
  // The same on this build's real GPU runtime (the last device for the target); false when
  // there is no device, with the runtime's reason in `why`.
  bool StartOnRealDevice(std::string* why) {
    rt_ = &gpu::DefaultRuntime();
    absl::StatusOr<int> devices = rt_->DeviceCount();
    if (!devices.ok() || *devices < 1) {
      *why = devices.ok() ? "no GPU device" : std::string(devices.status().message());
      return false;
    }
    auto stream = gpu::Stream::Create(*rt_, 0);
    EXPECT_TRUE(stream.ok()) << stream.status();
    if (stream.ok()) test_stream_ = *std::move(stream);
    StartEngines(4 << 20, 0, *devices - 1);
    return true;
  }
  void StartEngines(uint64_t max_op_bytes, int initiator_device, int target_device) {
    initiator_ = MakeEngine("initiator", max_op_bytes);
    target_ = MakeEngine("target", max_op_bytes);
    ASSERT_NE(initiator_, nullptr);
    ASSERT_NE(target_, nullptr);
    ASSERT_NO_FATAL_FAILURE(Register(*initiator_, initiator_device, &local_));
    ASSERT_NO_FATAL_FAILURE(Register(*target_, target_device, &remote_));
    auto peer = initiator_->Connect(target_->address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    for (RegionId r : {remote_.host_id, remote_.gpu_id}) {
      ASSERT_TRUE(initiator_->WaitForRemoteRegion(peer_, r, absl::Seconds(10)).ok());
    }
  }

  void TearDown() override {
    initiator_.reset();
    target_.reset();
    local_.device = gpu::DeviceBuffer();
    remote_.device = gpu::DeviceBuffer();
    test_stream_ = gpu::Stream();
    gpu::SetDefaultRuntime(nullptr);
    emulated_.reset();
  }

  std::unique_ptr<Engine> MakeEngine(const std::string& name, uint64_t max_op_bytes) {
    EngineOptions options;
    options.name = name;
    options.transport = "tcp";
    options.tcp().connections = 4;
    // Ops stay whole up to this (4 MiB: one op spans several staging chunks).
    options.max_op_bytes = max_op_bytes;
    auto engine = Engine::Create(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? *std::move(engine) : nullptr;
  }

  void Register(Engine& engine, int device, Memory* memory) {
    memory->host.assign(region_bytes_, kPoison);
    auto buffer = gpu::DeviceBuffer::Allocate(*rt_, device, region_bytes_);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    memory->device = *std::move(buffer);
    RegionOptions options;
    options.export_to_all_peers = true;
    auto host = engine.RegisterMemory(memory->host.data(), region_bytes_, options);
    ASSERT_TRUE(host.ok()) << host.status();
    memory->host_id = *host;
    options.kind = MemoryKind::kGpu;
    auto dev = engine.RegisterMemory(memory->device.data(), region_bytes_, options);
    ASSERT_TRUE(dev.ok()) << dev.status();
    memory->gpu_id = *dev;
  }

  RegionId Region(const Memory& m, Where w) const {
    return w == Where::kHost ? m.host_id : m.gpu_id;
  }

  // Writes `bytes` at `offset` of one side's host or GPU memory (GPU: through the emulated
  // runtime's test access, or a synchronous copy on a real device).
  void Put(Memory& m, Where w, uint64_t offset, const std::vector<std::byte>& bytes) {
    std::byte* device = static_cast<std::byte*>(m.device.data()) + offset;
    if (w == Where::kHost) {
      std::copy(bytes.begin(), bytes.end(), m.host.begin() + offset);
    } else if (emulated_ != nullptr) {
      ASSERT_TRUE(emulated_->WriteDevice(device, bytes.data(), bytes.size()).ok());
    } else {
      absl::Status s = test_stream_.Copy(device, bytes.data(), bytes.size());
      ASSERT_TRUE(s.ok()) << s;
    }
  }
  std::vector<std::byte> Get(const Memory& m, Where w, uint64_t offset, uint64_t length) {
    std::vector<std::byte> out(length);
    const std::byte* device = static_cast<const std::byte*>(m.device.data()) + offset;
    if (w == Where::kHost) {
      std::copy_n(m.host.begin() + offset, length, out.begin());
    } else if (emulated_ != nullptr) {
      EXPECT_TRUE(emulated_->ReadDevice(out.data(), device, length).ok());
    } else {
      absl::Status s = test_stream_.Copy(out.data(), device, length);
      EXPECT_TRUE(s.ok()) << s;
    }
    return out;
  }
  // Poisons [offset, offset + length) of one side's memory.
  void Poison(Memory& m, Where w, uint64_t offset, uint64_t length) {
    Put(m, w, offset, std::vector<std::byte>(length, kPoison));
  }

  absl::Status Run(OpKind kind, const std::vector<Op>& ops,
                   TransferOptions options = TransferOptions()) {
    auto id = initiator_->Transfer(peer_, kind, ops, options);
    if (!id.ok()) return id.status();
    return initiator_->Wait(*id, kWait);
  }

  static uint64_t Staged(const Engine& engine) {
    return engine.Stats().TransportStatValue("gpu", "tcp_staged_bytes");
  }

  std::unique_ptr<EmulatedGpu> emulated_;  // null on a real device
  gpu::Runtime* rt_ = nullptr;
  uint64_t region_bytes_ = kRegionBytes;
  gpu::Stream test_stream_;  // a real device's test copies
  std::unique_ptr<Engine> initiator_;
  std::unique_ptr<Engine> target_;
  Memory local_;
  Memory remote_;
  PeerId peer_ = 0;
};

// The emulated GPU without and with a copy delay, and this build's real GPU runtime (skipped
// where there is no device).
struct Variant {
  std::string name;
  bool real_device = false;
  absl::Duration copy_delay;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class TcpGpuTest : public TcpGpuFixture, public ::testing::WithParamInterface<Variant> {
 protected:
  void SetUp() override {
    if (!GetParam().real_device) {
      ASSERT_NO_FATAL_FAILURE(Start(GetParam().copy_delay));
      return;
    }
    std::string why;
    if (!StartOnRealDevice(&why)) GTEST_SKIP() << why;
  }
};

// WRITE then READ back of one contiguous range, for every pairing of host and GPU memory and
// sizes from a few bytes to tens of MiB (not multiples of the 1 MiB staging chunk).
TEST_P(TcpGpuTest, WritesAndReadsEveryPairingByteExact) {
  const std::vector<uint64_t> sizes = {
      1, 7, 4099, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (3 << 20) + 12345, (24 << 20) + 5};
  uint64_t seed = 1;
  for (Where local : {Where::kGpu, Where::kHost}) {
    for (Where remote : {Where::kGpu, Where::kHost}) {
      if (local == Where::kHost && remote == Where::kHost) continue;  // the host path's tests
      // Every size gets its own target range: a target's sendmsg (host READ) may still read
      // its bytes after the initiator has them, so the test never rewrites them.
      uint64_t remote_base = 0;
      for (uint64_t size : sizes) {
        SCOPED_TRACE(absl::StrCat(Name(local), " <-> ", Name(remote), ", ", size, " bytes"));
        // Odd offsets: ranges do not start at chunk or page boundaries.
        const uint64_t local_offset = 13 + size % 1000;
        const uint64_t remote_offset = remote_base + 101 + size % 777;
        remote_base = remote_offset + size + 1;
        ASSERT_LE(remote_base, kRegionBytes);
        std::vector<std::byte> data(size);
        Fill(data, seed++);

        // WRITE: local (data) -> remote (poison, one byte more either side).
        ASSERT_NO_FATAL_FAILURE(Poison(remote_, remote, remote_offset - 1, size + 2));
        ASSERT_NO_FATAL_FAILURE(Put(local_, local, local_offset, data));
        uint64_t staged_i = Staged(*initiator_), staged_t = Staged(*target_);
        const Op op{Region(local_, local), local_offset, Region(remote_, remote), remote_offset,
                    size};
        absl::Status s = Run(OpKind::kWrite, {op});
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_EQ(FirstDifference(Get(remote_, remote, remote_offset, size), data), -1);
        // Nothing written outside the range.
        EXPECT_EQ(Get(remote_, remote, remote_offset - 1, 1)[0], kPoison);
        EXPECT_EQ(Get(remote_, remote, remote_offset + size, 1)[0], kPoison);
        EXPECT_EQ(Staged(*initiator_) - staged_i, local == Where::kGpu ? size : 0);
        EXPECT_EQ(Staged(*target_) - staged_t, remote == Where::kGpu ? size : 0);

        // READ: remote (data) -> local (poison).
        ASSERT_NO_FATAL_FAILURE(Poison(local_, local, local_offset - 1, size + 2));
        staged_i = Staged(*initiator_);
        staged_t = Staged(*target_);
        s = Run(OpKind::kRead, {op});
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_EQ(FirstDifference(Get(local_, local, local_offset, size), data), -1);
        EXPECT_EQ(Get(local_, local, local_offset - 1, 1)[0], kPoison);
        EXPECT_EQ(Get(local_, local, local_offset + size, 1)[0], kPoison);
        EXPECT_EQ(Staged(*initiator_) - staged_i, local == Where::kGpu ? size : 0);
        EXPECT_EQ(Staged(*target_) - staged_t, remote == Where::kGpu ? size : 0);
      }
    }
  }
}

// Thousands of small scattered pieces in one transfer (many per staging chunk and per writer
// batch), host and GPU pieces mixed on the initiator, GPU on the target.
TEST_P(TcpGpuTest, ThousandsOfSmallPiecesByteExact) {
  constexpr int kPieces = 3000;
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<uint64_t> len(1, 3000);
  struct Piece {
    Where local;
    uint64_t local_offset, remote_offset, length;
  };
  std::vector<Piece> pieces;
  uint64_t local_at = 0, remote_at = 0, total = 0, gpu_bytes = 0;
  for (int i = 0; i < kPieces; ++i) {
    const uint64_t n = len(rng);
    const Where where = i % 3 == 0 ? Where::kHost : Where::kGpu;
    pieces.push_back({where, local_at, remote_at, n});
    local_at += n + rng() % 64;  // gaps: nothing merges
    remote_at += n + 1 + rng() % 64;
    total += n;
    gpu_bytes += where == Where::kGpu ? n : 0;
  }
  constexpr uint64_t kSpan = 8 << 20;
  ASSERT_LT(std::max(local_at, remote_at), kSpan);
  std::shuffle(pieces.begin(), pieces.end(), rng);

  std::vector<std::byte> host_src(kSpan), gpu_src(kSpan);
  Fill(host_src, 5);
  Fill(gpu_src, 6);
  ASSERT_NO_FATAL_FAILURE(Put(local_, Where::kHost, 0, host_src));
  ASSERT_NO_FATAL_FAILURE(Put(local_, Where::kGpu, 0, gpu_src));
  ASSERT_NO_FATAL_FAILURE(Poison(remote_, Where::kGpu, 0, kSpan));
  std::vector<Op> ops;
  for (const Piece& p : pieces) {
    ops.push_back(
        {Region(local_, p.local), p.local_offset, remote_.gpu_id, p.remote_offset, p.length});
  }
  uint64_t staged_i = Staged(*initiator_), staged_t = Staged(*target_);
  absl::Status s = Run(OpKind::kWrite, ops);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Staged(*initiator_) - staged_i, gpu_bytes);
  EXPECT_EQ(Staged(*target_) - staged_t, total);
  std::vector<std::byte> expected(kSpan, kPoison);
  for (const Piece& p : pieces) {
    const std::vector<std::byte>& src = p.local == Where::kHost ? host_src : gpu_src;
    std::copy_n(src.begin() + p.local_offset, p.length, expected.begin() + p.remote_offset);
  }
  EXPECT_EQ(FirstDifference(Get(remote_, Where::kGpu, 0, kSpan), expected), -1);

  // READ them back into poisoned local memory.
  ASSERT_NO_FATAL_FAILURE(Poison(local_, Where::kHost, 0, kSpan));
  ASSERT_NO_FATAL_FAILURE(Poison(local_, Where::kGpu, 0, kSpan));
  staged_i = Staged(*initiator_);
  staged_t = Staged(*target_);
  s = Run(OpKind::kRead, ops);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Staged(*initiator_) - staged_i, gpu_bytes);
  EXPECT_EQ(Staged(*target_) - staged_t, total);
  std::vector<std::byte> expected_host(kSpan, kPoison), expected_gpu(kSpan, kPoison);
  for (const Piece& p : pieces) {
    std::vector<std::byte>& dst = p.local == Where::kHost ? expected_host : expected_gpu;
    std::copy_n(expected.begin() + p.remote_offset, p.length, dst.begin() + p.local_offset);
  }
  EXPECT_EQ(FirstDifference(Get(local_, Where::kHost, 0, kSpan), expected_host), -1);
  EXPECT_EQ(FirstDifference(Get(local_, Where::kGpu, 0, kSpan), expected_gpu), -1);
}

// Several transfers in flight at once over the lanes, GPU on both sides, each verified.
TEST_P(TcpGpuTest, ConcurrentTransfersOnSeveralLanes) {
  constexpr int kTransfers = 8;
  constexpr uint64_t kBytes = (2 << 20) + 333;
  std::vector<std::byte> data(kBytes * kTransfers);
  Fill(data, 9);
  ASSERT_NO_FATAL_FAILURE(Put(local_, Where::kGpu, 0, data));
  ASSERT_NO_FATAL_FAILURE(Poison(remote_, Where::kGpu, 0, kRegionBytes));
  std::vector<TransferId> ids;
  for (int i = 0; i < kTransfers; ++i) {
    auto id = initiator_->Transfer(
        peer_, OpKind::kWrite, {Op{local_.gpu_id, i * kBytes, remote_.gpu_id, i * kBytes, kBytes}});
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (TransferId id : ids) {
    absl::Status s = initiator_->Wait(id, kWait);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(FirstDifference(Get(remote_, Where::kGpu, 0, data.size()), data), -1);
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, TcpGpuTest,
    ::testing::Values(Variant{"EmulatedNoDelay", false, absl::ZeroDuration()},
                      Variant{"EmulatedCopyDelay", false, absl::Microseconds(300)},
                      Variant{"RealDevice", true, absl::ZeroDuration()}),
    [](const ::testing::TestParamInfo<Variant>& info) { return info.param.name; });

// Copies so slow (kSlowCopy each) that a READ of 32 MiB into GPU memory (one 8 MiB op per
// lane: 8 staging chunks each) cannot finish within its deadline: the payload arrives faster
// than it can be copied to the device. Regions of 64 MiB: room for a second READ.
class TcpGpuCancelTest : public TcpGpuFixture {
 protected:
  static constexpr absl::Duration kSlowCopy = absl::Milliseconds(40);
  static constexpr uint64_t kOpBytes = 8 << 20;
  static constexpr uint64_t kBytes = 32 << 20;
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(Start(kSlowCopy, kOpBytes, 2 * kBytes)); }

  std::vector<Op> ReadOps(uint64_t local_base) const {
    std::vector<Op> ops;
    for (uint64_t at = 0; at < kBytes; at += kOpBytes) {
      ops.push_back({local_.gpu_id, local_base + at, remote_.host_id, at, kOpBytes});
    }
    return ops;
  }
};

// A READ into GPU memory ended by its deadline while its payload is still arriving: once the
// engine ended the transfer no copy to the device is queued any more (the staged-bytes
// counter holds still: without the cancellation checks, each lane would go on for 150-250 ms
// copying the rest of its op), every staging chunk queued before lands whole and nothing
// else does, and the lanes stay usable.
TEST_F(TcpGpuCancelTest, ReadCancelledByDeadlineMidPayloadLeavesDeviceMemoryAlone) {
  std::vector<std::byte> data(kBytes);
  Fill(data, 11);
  ASSERT_NO_FATAL_FAILURE(Put(remote_, Where::kHost, 0, data));
  ASSERT_NO_FATAL_FAILURE(Poison(local_, Where::kGpu, 0, 2 * kBytes));
  // 8 chunk copies of kSlowCopy per lane: >= 320 ms; the deadline is far sooner.
  TransferOptions options;
  options.timeout = absl::Milliseconds(60);
  const uint64_t staged_before = Staged(*initiator_);
  absl::Status s = Run(OpKind::kRead, ReadOps(0), options);
  ASSERT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  // A second READ, into the other half, over the same lanes: exact, and once it is done so
  // are the copies the first one queued (each lane finishes one request before the next).
  // That is the condition waited for (no sleep): the first READ's staging is then final.
  s = Run(OpKind::kRead, ReadOps(kBytes));
  ASSERT_TRUE(s.ok()) << s;
  const uint64_t staged_at_end = Staged(*initiator_) - staged_before - kBytes;
  // Mid-payload: the lanes stopped queueing copies for the cancelled READ (8 copies of
  // kSlowCopy per lane could not all fit before its 60 ms deadline).
  EXPECT_LT(staged_at_end, kBytes) << "the cancelled READ staged everything";
  EXPECT_EQ(FirstDifference(Get(local_, Where::kGpu, kBytes, kBytes), data), -1);
  // Each 1 MiB staging chunk of the cancelled READ landed whole or not at all, and exactly
  // the chunks counted as staged before the end landed.
  const std::vector<std::byte> cancelled = Get(local_, Where::kGpu, 0, kBytes);
  const std::vector<std::byte> poison(kStagingChunk, kPoison);
  uint64_t landed = 0;
  for (uint64_t at = 0; at < kBytes; at += kStagingChunk) {
    const bool is_data =
        std::equal(data.begin() + at, data.begin() + at + kStagingChunk, cancelled.begin() + at);
    const bool is_poison = std::equal(poison.begin(), poison.end(), cancelled.begin() + at);
    EXPECT_TRUE(is_data || is_poison) << "chunk at " << at << " is neither data nor untouched";
    landed += is_data ? kStagingChunk : 0;
  }
  EXPECT_EQ(landed, staged_at_end);
}

// Not a speed assertion: prints the throughput of staged transfers next to the host path's
// in this process (EMULATED GPU: "device" copies are memcpy on stream threads, so this shows
// the staging pipeline's overhead, not PCIe), and checks the bytes.
class TcpGpuThroughputTest : public TcpGpuFixture {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(Start(absl::ZeroDuration())); }
};

TEST_F(TcpGpuThroughputTest, PrintsEmulatedStagedThroughput) {
  constexpr uint64_t kBytes = 32 << 20;
  constexpr int kRounds = 2;
  std::vector<std::byte> data(kBytes);
  Fill(data, 21);
  for (Where w : {Where::kHost, Where::kGpu}) {
    ASSERT_NO_FATAL_FAILURE(Put(local_, w, 0, data));
    for (OpKind kind : {OpKind::kWrite, OpKind::kRead}) {
      std::vector<Op> ops;
      for (uint64_t at = 0; at < kBytes; at += 4 << 20) {
        ops.push_back({Region(local_, w), at, Region(remote_, w), at, 4 << 20});
      }
      const absl::Time start = absl::Now();
      for (int i = 0; i < kRounds; ++i) {
        absl::Status s = Run(kind, ops);
        ASSERT_TRUE(s.ok()) << s;
      }
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
      std::cout << "[ emulated ] tcp " << (kind == OpKind::kWrite ? "WRITE" : "READ ") << " "
                << Name(w) << "->" << Name(w) << " " << kRounds << " x " << (kBytes >> 20)
                << " MiB, 4 lanes: " << static_cast<int>(kRounds * kBytes / seconds / 1e6)
                << " MB/s" << (w == Where::kGpu ? " (EMULATED GPU, staged both sides)" : "")
                << std::endl;
    }
    EXPECT_EQ(FirstDifference(Get(remote_, w, 0, kBytes), data), -1);
    EXPECT_EQ(FirstDifference(Get(local_, w, 0, kBytes), data), -1);
  }
}

}  // namespace
}  // namespace kvwire::testing
