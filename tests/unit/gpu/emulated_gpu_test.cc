// The emulated GPU runtime behaves like a device where the engine's tests rely on it: device
// memory faults on CPU access, copies are asynchronous, events order streams, IPC handles
// open in another process, and the engine registers its memory as kGpu.
#include "tests/support/emulated_gpu.h"

#include <sys/wait.h>

#include <cstring>
#include <unistd.h>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "kvwire/engine.h"
#include "src/gpu/kv_record_cpu.h"
#include "tests/unit/gpu/gpu_test_util.h"

namespace kvwire::testing {
namespace {

using gpu::testing::Pattern;

TEST(EmulatedGpu, DeviceMemoryFaultsOnCpuAccess) {
  EmulatedGpu emulated;
  auto buf = gpu::DeviceBuffer::Allocate(emulated.runtime(), 0, 4096);
  ASSERT_TRUE(buf.ok()) << buf.status();
  volatile auto* p = static_cast<volatile uint8_t*>(buf->data());
  EXPECT_DEATH((void)p[0], "");
}

TEST(EmulatedGpu, HostAccessibleMemoryIsReadable) {
  EmulatedGpu emulated({.host_accessible = true});
  auto buf = gpu::DeviceBuffer::Allocate(emulated.runtime(), 0, 4096);
  ASSERT_TRUE(buf.ok()) << buf.status();
  const std::vector<uint8_t> src = Pattern(4096, 3);
  ASSERT_TRUE(emulated.WriteDevice(buf->data(), src.data(), src.size()).ok());
  EXPECT_EQ(std::memcmp(buf->data(), src.data(), src.size()), 0);
}

TEST(EmulatedGpu, CopiesAreAsynchronousUntilSynchronized) {
  EmulatedGpu emulated({.copy_delay = absl::Milliseconds(200)});
  gpu::Runtime& rt = emulated.runtime();
  auto dev = gpu::DeviceBuffer::Allocate(rt, 0, 1 << 16);
  auto stream = gpu::Stream::Create(rt, 0);
  ASSERT_TRUE(dev.ok() && stream.ok());
  const std::vector<uint8_t> src = Pattern(1 << 16, 7);
  std::vector<uint8_t> back(1 << 16, 0);
  ASSERT_TRUE(stream->CopyAsync(dev->data(), src.data(), src.size()).ok());
  ASSERT_TRUE(stream->CopyAsync(back.data(), dev->data(), back.size()).ok());
  // Both copies are queued behind a 200 ms delay: nothing has landed yet.
  EXPECT_EQ(back, std::vector<uint8_t>(1 << 16, 0));
  ASSERT_TRUE(stream->Synchronize().ok());
  EXPECT_EQ(back, src);
  EXPECT_EQ(emulated.counters().copies, 2u);
  EXPECT_EQ(emulated.counters().copy_bytes, 2u << 16);
}

TEST(EmulatedGpu, EventsOrderStreams) {
  EmulatedGpu emulated({.copy_delay = absl::Milliseconds(100)});
  gpu::Runtime& rt = emulated.runtime();
  auto dev = gpu::DeviceBuffer::Allocate(rt, 0, 4096);
  auto producer = gpu::Stream::Create(rt, 0);
  auto consumer = gpu::Stream::Create(rt, 0);
  auto event = gpu::Event::Create(rt, 0);
  ASSERT_TRUE(dev.ok() && producer.ok() && consumer.ok() && event.ok());
  auto never_recorded = event->Done();
  ASSERT_TRUE(never_recorded.ok());
  EXPECT_TRUE(*never_recorded);  // as in CUDA: an unrecorded event is complete
  const std::vector<uint8_t> src = Pattern(4096, 9);
  std::vector<uint8_t> back(4096, 0);
  ASSERT_TRUE(producer->CopyAsync(dev->data(), src.data(), src.size()).ok());
  ASSERT_TRUE(event->Record(*producer).ok());
  auto done = event->Done();
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done);
  ASSERT_TRUE(consumer->Wait(*event).ok());
  ASSERT_TRUE(consumer->CopyAsync(back.data(), dev->data(), back.size()).ok());
  ASSERT_TRUE(consumer->Synchronize().ok());
  EXPECT_EQ(back, src);  // the consumer's copy ran after the producer's
  done = event->Done();
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
}

// The bounded waits the transports use instead of an unbounded synchronize.
TEST(EmulatedGpu, WaitForEventGivesUpAtItsDeadline) {
  EmulatedGpu emulated({.copy_delay = absl::Milliseconds(400)});
  gpu::Runtime& rt = emulated.runtime();
  auto dev = gpu::DeviceBuffer::Allocate(rt, 0, 4096);
  auto stream = gpu::Stream::Create(rt, 0);
  auto event = gpu::Event::Create(rt, 0);
  ASSERT_TRUE(dev.ok() && stream.ok() && event.ok());
  std::vector<uint8_t> host(4096, 1);
  ASSERT_TRUE(stream->CopyAsync(dev->data(), host.data(), host.size()).ok());
  absl::Status late = gpu::WaitForStream(rt, 0, stream->native(), event->native(),
                                         absl::Now() + absl::Milliseconds(50), "a slow copy");
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_NE(late.message().find("a slow copy"), std::string::npos) << late;
  EXPECT_TRUE(
      gpu::WaitForEvent(rt, 0, event->native(), absl::Now() + absl::Seconds(30), "copy").ok());
}

TEST(EmulatedGpu, QueryPointerFindsTheAllocationOfASubRange) {
  EmulatedGpu emulated({.devices = 2});
  gpu::Runtime& rt = emulated.runtime();
  auto buf = gpu::DeviceBuffer::Allocate(rt, 1, 3 * 4096);
  ASSERT_TRUE(buf.ok());
  auto info = rt.QueryPointer(static_cast<std::byte*>(buf->data()) + 5000);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->device, 1);
  EXPECT_EQ(info->allocation_base, buf->data());
  EXPECT_EQ(info->allocation_size, 3u * 4096);
  std::vector<uint8_t> host(16);
  EXPECT_EQ(rt.QueryPointer(host.data()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(gpu::DeviceBuffer::Allocate(rt, 2, 4096).ok());  // only devices 0 and 1
}

TEST(EmulatedGpu, IpcHandleOpensInAnotherProcess) {
  EmulatedGpu emulated;
  gpu::Runtime& rt = emulated.runtime();
  auto buf = gpu::DeviceBuffer::Allocate(rt, 0, 8192);
  ASSERT_TRUE(buf.ok());
  const std::vector<uint8_t> src = Pattern(8192, 11);
  ASSERT_TRUE(emulated.WriteDevice(buf->data(), src.data(), src.size()).ok());
  auto handle = rt.ExportIpc(0, buf->data());
  ASSERT_TRUE(handle.ok()) << handle.status();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Another process with its own emulated runtime: reads the pattern and inverts it.
    EmulatedGpu other;
    auto mapping = gpu::IpcMapping::Open(other.runtime(), 0, *handle);
    if (!mapping.ok()) _exit(2);
    std::vector<uint8_t> seen(8192);
    if (!other.ReadDevice(seen.data(), mapping->data(), seen.size()).ok()) _exit(3);
    if (seen != src) _exit(4);
    for (uint8_t& b : seen) b = static_cast<uint8_t>(~b);
    if (!other.WriteDevice(mapping->data(), seen.data(), seen.size()).ok()) _exit(5);
    _exit(other.counters().ipc_opens == 1 ? 0 : 6);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  std::vector<uint8_t> back(8192);
  ASSERT_TRUE(emulated.ReadDevice(back.data(), buf->data(), back.size()).ok());
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], static_cast<uint8_t>(~src[i]));
  gpu::IpcHandle forged = *handle;
  forged.bytes[0] ^= 1;
  EXPECT_FALSE(rt.OpenIpc(0, forged).ok());
}

TEST(EmulatedGpu, EncodeKvRecordsMatchesTheCpuEncoder) {
  EmulatedGpu emulated;
  gpu::Runtime& rt = emulated.runtime();
  constexpr uint32_t kTokens = 5, kBlock = 2, kPages = 4;
  constexpr uint64_t kPageBytes = kBlock * (gpu::kKvDataRowBytes + gpu::kKvScaleRowBytes);
  std::vector<float> src(kTokens * gpu::kKvInputDims);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>((i % 97) - 48) * 0.37f;
  const std::vector<int64_t> slots = {0, 3, -1, 6, 7};
  auto d_src = gpu::DeviceBuffer::Allocate(rt, 0, src.size() * sizeof(float));
  auto d_slots = gpu::DeviceBuffer::Allocate(rt, 0, slots.size() * sizeof(int64_t));
  auto d_cache = gpu::DeviceBuffer::Allocate(rt, 0, kPages * kPageBytes);
  auto stream = gpu::Stream::Create(rt, 0);
  ASSERT_TRUE(d_src.ok() && d_slots.ok() && d_cache.ok() && stream.ok());
  ASSERT_TRUE(stream->Copy(d_src->data(), src.data(), src.size() * sizeof(float)).ok());
  ASSERT_TRUE(stream->Copy(d_slots->data(), slots.data(), slots.size() * sizeof(int64_t)).ok());
  std::vector<uint8_t> zeros(kPages * kPageBytes, 0);
  ASSERT_TRUE(stream->Copy(d_cache->data(), zeros.data(), zeros.size()).ok());
  gpu::KvEncodeArgs args;
  args.src = static_cast<const float*>(d_src->data());
  args.slots = static_cast<const int64_t*>(d_slots->data());
  args.cache = static_cast<uint8_t*>(d_cache->data());
  args.page_bytes = kPageBytes;
  args.num_slots = kPages * kBlock;
  args.block_size = kBlock;
  args.num_tokens = kTokens;
  absl::Status encoded = stream->EncodeKvRecords(args);
  ASSERT_TRUE(encoded.ok()) << encoded;
  std::vector<uint8_t> got(zeros.size());
  ASSERT_TRUE(stream->Copy(got.data(), d_cache->data(), got.size()).ok());

  std::vector<uint8_t> want(zeros.size(), 0);
  gpu::KvEncodeArgs host = args;
  host.src = src.data();
  host.slots = slots.data();
  host.cache = want.data();
  ASSERT_TRUE(gpu::EncodeKvRecordsCpu(host).ok());
  EXPECT_EQ(got, want);
  EXPECT_NE(want, zeros);
}

// The engine registers emulated device memory as a GPU region (device and allocation from
// the runtime) and refuses host memory or the wrong device under kGpu.
TEST(EmulatedGpu, EngineRegistersGpuRegionsFromTheRuntime) {
  EmulatedGpu emulated({.devices = 2});
  gpu::SetDefaultRuntime(&emulated.runtime());
  auto buf = gpu::DeviceBuffer::Allocate(emulated.runtime(), 1, 1 << 20);
  ASSERT_TRUE(buf.ok());
  {
    EngineOptions options;
    options.name = "emulated-gpu-engine";
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    RegionOptions gpu_region;
    gpu_region.kind = MemoryKind::kGpu;
    auto* inside = static_cast<std::byte*>(buf->data()) + 4096;
    auto id = (*engine)->RegisterMemory(inside, 64 << 10, gpu_region);
    // Which transports take it depends on their GPU support; the engine must either register
    // it with at least one, or refuse naming the transports that declined.
    if (id.ok()) {
      EXPECT_EQ((*engine)->Stats().gpu.regions, 1u);
      EXPECT_NE((*engine)->Stats().ToJson().find("\"gpu\":{\"regions\":1"), std::string::npos);
    } else {
      EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
      EXPECT_THAT(std::string(id.status().message()), ::testing::HasSubstr("declined: tcp"));
    }
    gpu_region.gpu_device = 0;
    auto wrong = (*engine)->RegisterMemory(inside, 4096, gpu_region);
    ASSERT_FALSE(wrong.ok());
    EXPECT_THAT(std::string(wrong.status().message()),
                ::testing::HasSubstr("belongs to device 1, not to device 0"));
    gpu_region.gpu_device = -1;
    auto past = (*engine)->RegisterMemory(inside, 1 << 20, gpu_region);
    ASSERT_FALSE(past.ok());
    EXPECT_THAT(std::string(past.status().message()), ::testing::HasSubstr("run past"));
    std::vector<uint8_t> host(4096);
    auto not_device = (*engine)->RegisterMemory(host.data(), host.size(), gpu_region);
    ASSERT_FALSE(not_device.ok());
    EXPECT_THAT(std::string(not_device.status().message()),
                ::testing::HasSubstr("not emulated device memory"));
  }
  gpu::SetDefaultRuntime(nullptr);
}

}  // namespace
}  // namespace kvwire::testing
