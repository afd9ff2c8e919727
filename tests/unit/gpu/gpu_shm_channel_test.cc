// The shm transport's GPU path in one process, with the emulated runtime: region keys (format,
// refusals of wrong or damaged keys), device copies completed asynchronously, cancellation
// before and during the copies. Two processes (IPC handles really opened) are in
// tests/integration/shm_gpu_test.cc.
#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/gpu/runtime.h"
#include "src/util/mutex.h"
#include "tests/support/emulated_gpu.h"
#include "tests/support/fake_target_hooks.h"
#include "transport/shm/gpu_region_key.h"
#include "transport/shm/shm_transport.h"

namespace kvwire::transport {
namespace {

using kvwire::testing::EmulatedGpu;
using kvwire::testing::EmulatedGpuOptions;
using ::kvwire::testing::FakeTargetHooks;
using ::kvwire::testing::OnePeer;
using ::testing::HasSubstr;

constexpr PeerId kPeer = 3;
constexpr char kToken[] = "token-of-peer-3";
constexpr uint64_t kRegionBytes = 1 << 20;
constexpr uint64_t kRegionOffset = 8192;

uint8_t Byte(uint64_t i, uint32_t seed) { return static_cast<uint8_t>((i ^ (i >> 9)) * 37 + seed); }

class GpuShmChannelTest : public ::testing::Test {
 protected:
  void Init(absl::Duration copy_delay) {
    emulated_ =
        std::make_unique<EmulatedGpu>(EmulatedGpuOptions{.devices = 1, .copy_delay = copy_delay});
    gpu::Runtime& rt = emulated_->runtime();
    ShmTransportOptions options;
    options.gpu_runtime = &rt;
    options.request_timeout = absl::Seconds(20);
    options.engine_name = "target";
    auto target = CreateShmTransport(options, &hooks_);
    ASSERT_TRUE(target.ok()) << target.status();
    target_ = std::move(*target);
    options.engine_name = "initiator";
    auto initiator = CreateShmTransport(options, &hooks_);
    ASSERT_TRUE(initiator.ok()) << initiator.status();
    initiator_ = std::move(*initiator);
    ASSERT_TRUE(target_->caps().gpu_memory);

    auto remote = gpu::DeviceBuffer::Allocate(rt, 0, kRegionBytes + 2 * kRegionOffset);
    ASSERT_TRUE(remote.ok()) << remote.status();
    remote_ = std::move(*remote);
    auto local = gpu::DeviceBuffer::Allocate(rt, 0, kRegionBytes);
    ASSERT_TRUE(local.ok()) << local.status();
    local_ = std::move(*local);
    std::vector<uint8_t> fill(kRegionBytes);
    for (uint64_t i = 0; i < fill.size(); ++i) fill[i] = Byte(i, 1);
    ASSERT_TRUE(emulated_->WriteDevice(RemoteBase(), fill.data(), fill.size()).ok());
    for (uint64_t i = 0; i < fill.size(); ++i) fill[i] = 0xEE;
    ASSERT_TRUE(emulated_->WriteDevice(local_.data(), fill.data(), fill.size()).ok());

    region_.id = 42;
    region_.base = RemoteBase();
    region_.length = kRegionBytes;
    region_.access = kRemoteReadWrite;
    region_.kind = MemoryKind::kGpu;
    region_.gpu_device = 0;
    region_.gpu_allocation_base = static_cast<std::byte*>(remote_.data());
    region_.gpu_allocation_size = remote_.size();
    ASSERT_TRUE(target_->RegisterRegion(region_).ok());

    PeerLink link;
    link.peer = 1;
    link.peer_name = "target";
    link.remote_endpoint = target_->Endpoint();
    link.token = kToken;
    link.remote_pid = static_cast<uint32_t>(getpid());
    link.deadline = absl::Now() + absl::Seconds(20);
    auto channel = initiator_->Connect(link);
    ASSERT_TRUE(channel.ok()) << channel.status();
    channel_ = std::move(*channel);
  }

  void TearDown() override {
    channel_.reset();
    initiator_.reset();
    target_.reset();
    local_ = gpu::DeviceBuffer();
    remote_ = gpu::DeviceBuffer();
    emulated_.reset();
  }

  std::byte* RemoteBase() const { return static_cast<std::byte*>(remote_.data()) + kRegionOffset; }

  RemoteRegionDesc Desc(const std::string& key) const {
    RemoteRegionDesc desc;
    desc.id = region_.id;
    desc.length = region_.length;
    desc.access = region_.access;
    desc.kind = MemoryKind::kGpu;
    desc.address = reinterpret_cast<uintptr_t>(region_.base);
    EXPECT_TRUE(desc.SetKey(key));
    return desc;
  }

  PostRequest Read(uint64_t remote_offset, uint64_t length) {
    PostRequest request;
    request.transfer_id = 9;
    request.kind = OpKind::kRead;
    request.ops.push_back(WireOp{static_cast<std::byte*>(local_.data()) + remote_offset, region_.id,
                                 remote_offset, length, 0});
    request.cancelled = std::make_shared<std::atomic<bool>>(false);
    return request;
  }

  // Posts and waits (bounded) for `done`, which must run exactly once.
  absl::Status PostAndWait(PostRequest request, absl::Duration timeout = absl::Seconds(20)) {
    auto calls = std::make_shared<std::atomic<int>>(0);
    auto result = std::make_shared<std::promise<absl::Status>>();
    std::future<absl::Status> future = result->get_future();
    channel_->Post(std::move(request), [calls, result](absl::Status s) {
      if (calls->fetch_add(1) == 0) result->set_value(std::move(s));
    });
    if (future.wait_for(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout))) !=
        std::future_status::ready) {
      return absl::DeadlineExceededError("done did not run");
    }
    absl::Status status = future.get();
    EXPECT_EQ(calls->load(), 1);
    return status;
  }

  void ExpectLocal(uint64_t offset, uint64_t length, uint32_t seed) {
    std::vector<uint8_t> got(length);
    ASSERT_TRUE(
        emulated_->ReadDevice(got.data(), static_cast<std::byte*>(local_.data()) + offset, length)
            .ok());
    for (uint64_t i = 0; i < length; ++i) {
      ASSERT_EQ(got[i], Byte(offset + i, seed)) << "offset " << offset + i;
    }
  }

  FakeTargetHooks hooks_{OnePeer(kToken, kPeer)};
  std::unique_ptr<EmulatedGpu> emulated_;
  std::unique_ptr<Transport> target_, initiator_;
  std::unique_ptr<Channel> channel_;
  gpu::DeviceBuffer remote_, local_;
  LocalRegion region_;
};

TEST_F(GpuShmChannelTest, KeyDescribesTheRegionInItsAllocation) {
  Init(absl::ZeroDuration());
  const std::string key = target_->RegionKey(region_.id);
  ASSERT_EQ(key.size(), shm::kGpuRegionKeyBytes);
  ASSERT_LE(key.size(), RemoteRegionDesc::kMaxKeyBytes);
  auto parsed = shm::ParseGpuRegionKey(key);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->backend, gpu::Backend::kEmulated);
  EXPECT_EQ(parsed->device, 0);
  EXPECT_EQ(parsed->offset, kRegionOffset);
  EXPECT_EQ(parsed->length, kRegionBytes);
  EXPECT_EQ(parsed->allocation_size, remote_.size());
  EXPECT_EQ(parsed->process_nonce, shm::ShmProcessNonce());
  EXPECT_EQ(shm::EncodeGpuRegionKey(*parsed), key);
  EXPECT_EQ(shm::PackPciBusId("0000:3b:00.1"), 0x3bu << 8 | 1u);
  EXPECT_EQ(shm::PackPciBusId("garbage"), shm::kUnknownPciBusId);
  // A second region of the same allocation shares its IPC handle.
  LocalRegion second = region_;
  second.id = 43;
  second.base = static_cast<std::byte*>(remote_.data());
  second.length = 4096;
  ASSERT_TRUE(target_->RegisterRegion(second).ok());
  auto parsed2 = shm::ParseGpuRegionKey(target_->RegionKey(43));
  ASSERT_TRUE(parsed2.ok()) << parsed2.status();
  EXPECT_EQ(parsed2->handle.bytes, parsed->handle.bytes);
  EXPECT_EQ(parsed2->offset, 0u);
  target_->DeregisterRegion(43);
  EXPECT_TRUE(target_->RegionKey(43).empty());
  EXPECT_EQ(target_->RegionKey(region_.id), key);
}

TEST_F(GpuShmChannelTest, DamagedOrForeignKeysAreRefusedAndTheRegionIsNotUsed) {
  Init(absl::ZeroDuration());
  const std::string good = target_->RegionKey(region_.id);
  struct Case {
    std::string name;
    std::string key;
    uint64_t length;
    std::string expected;
  };
  std::vector<Case> cases;
  cases.push_back({"empty", "", kRegionBytes, "sent no shm key"});
  cases.push_back({"truncated", good.substr(0, 60), kRegionBytes, "truncated"});
  std::string bad = good;
  bad[0] = 'X';
  cases.push_back({"magic", bad, kRegionBytes, "magic"});
  bad = good;
  bad[3] = 9;
  cases.push_back({"version", bad, kRegionBytes, "version 9"});
  bad = good;
  bad[4] = static_cast<char>(gpu::Backend::kCuda);
  cases.push_back({"backend", bad, kRegionBytes, "exported by a cuda runtime"});
  bad = good;
  bad[4] = 77;
  cases.push_back({"unknown backend", bad, kRegionBytes, "unknown GPU backend 77"});
  bad = good;
  bad[88 + 3] = 0x7f;  // offset far past the allocation
  cases.push_back({"offset", bad, kRegionBytes, "inconsistent"});
  bad = good;
  bad[8] = bad[9] = bad[10] = bad[11] = static_cast<char>(0xff);
  cases.push_back({"device", bad, kRegionBytes, "device -1"});
  cases.push_back({"length", good, kRegionBytes - 1, "its key says"});
  for (const Case& c : cases) {
    RemoteRegionDesc desc = Desc(c.key);
    desc.length = c.length;
    absl::Status added = channel_->AddRemoteRegions({desc});
    EXPECT_FALSE(added.ok()) << c.name;
    EXPECT_THAT(added.message(), HasSubstr(c.expected)) << c.name;
    EXPECT_THAT(added.message(), HasSubstr("GPU region 42")) << c.name;
    absl::Status posted = PostAndWait(Read(0, 4096));
    EXPECT_EQ(posted.code(), absl::StatusCode::kNotFound) << c.name << ": " << posted;
  }
  EXPECT_EQ(emulated_->counters().copies, 0u);
  // The good key still works afterwards.
  ASSERT_TRUE(channel_->AddRemoteRegions({Desc(good)}).ok());
  ASSERT_TRUE(PostAndWait(Read(0, 4096)).ok());
  ExpectLocal(0, 4096, 1);
}

TEST_F(GpuShmChannelTest, DeviceCopiesCompleteBeforeDoneAndStatsCountThem) {
  Init(absl::Milliseconds(2));
  ASSERT_TRUE(channel_->AddRemoteRegions({Desc(target_->RegionKey(region_.id))}).ok());
  EXPECT_THAT(channel_->Describe(), HasSubstr("+gpu-ipc"));
  PostRequest request = Read(0, 300);
  for (uint64_t at = 1000; at + 5000 < kRegionBytes; at += 40000) {
    request.ops.push_back(
        WireOp{static_cast<std::byte*>(local_.data()) + at, region_.id, at, 5000, 0});
  }
  const size_t ops = request.ops.size();
  ASSERT_TRUE(PostAndWait(std::move(request)).ok());
  ExpectLocal(0, 300, 1);
  for (uint64_t at = 1000; at + 5000 < kRegionBytes; at += 40000) ExpectLocal(at, 5000, 1);
  EngineStats stats;
  stats.transport_stats = ShmTransportStats();
  initiator_->AddStats(&stats.transport_stats);
  EXPECT_EQ(stats.TransportStatValue("gpu", "shm_device_copies"), ops);
  // Same process: the region is used in place (a runtime cannot open its own IPC handle).
  EXPECT_EQ(stats.TransportStatValue("gpu", "shm_ipc_opens"), 0u);
  // WRITE back a changed range, then READ it into another place.
  std::vector<uint8_t> fill(65536);
  for (uint64_t i = 0; i < fill.size(); ++i) fill[i] = Byte(i, 5);
  ASSERT_TRUE(emulated_->WriteDevice(local_.data(), fill.data(), fill.size()).ok());
  PostRequest write;
  write.kind = OpKind::kWrite;
  write.ops.push_back(WireOp{static_cast<std::byte*>(local_.data()), region_.id, 0, 65536, 0});
  ASSERT_TRUE(PostAndWait(std::move(write)).ok());
  std::vector<uint8_t> got(65536);
  ASSERT_TRUE(emulated_->ReadDevice(got.data(), RemoteBase(), got.size()).ok());
  EXPECT_EQ(got, fill);
}

TEST_F(GpuShmChannelTest, CancelledRequestStartsNoCopy) {
  Init(absl::ZeroDuration());
  ASSERT_TRUE(channel_->AddRemoteRegions({Desc(target_->RegionKey(region_.id))}).ok());
  PostRequest request = Read(0, 4096);
  request.cancelled->store(true);
  const absl::Status status = PostAndWait(std::move(request));
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_EQ(emulated_->counters().copies, 0u);
}

TEST_F(GpuShmChannelTest, CancelledDuringCopiesReportsAtOnceButHoldsMemoryUntilTheyEnd) {
  Init(absl::Seconds(1));  // long enough to be cancelled midway on a loaded machine
  ASSERT_TRUE(channel_->AddRemoteRegions({Desc(target_->RegionKey(region_.id))}).ok());
  PostRequest request = Read(0, 4096);
  auto pin = std::make_shared<int>(0);
  std::weak_ptr<int> pin_alive = pin;
  request.pins.push_back(std::move(pin));
  std::shared_ptr<std::atomic<bool>> cancelled = request.cancelled;
  auto result = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> future = result->get_future();
  const absl::Time start = absl::Now();
  channel_->Post(std::move(request), [result](absl::Status s) { result->set_value(s); });
  // Cancelled once its (1 s) copy is queued on the stream: a condition, not a sleep.
  for (const absl::Time until = absl::Now() + absl::Seconds(10);
       emulated_->counters().copies == 0 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GT(emulated_->counters().copies, 0u) << "the copy was never queued";
  cancelled->store(true);
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const absl::Duration reported = absl::Now() - start;
  EXPECT_EQ(future.get().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(reported, absl::Milliseconds(800)) << "done waited for the copy";
  // The copy still runs into local memory: what the request pinned is still held.
  EXPECT_FALSE(pin_alive.expired());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!pin_alive.expired() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(pin_alive.expired());
  EXPECT_GE(absl::Now() - start, absl::Seconds(1));
}

TEST_F(GpuShmChannelTest, RegionRemovedDuringItsCopiesStillCompletes) {
  Init(absl::Milliseconds(100));
  ASSERT_TRUE(channel_->AddRemoteRegions({Desc(target_->RegionKey(region_.id))}).ok());
  auto result = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> future = result->get_future();
  channel_->Post(Read(0, 65536), [result](absl::Status s) { result->set_value(s); });
  channel_->RemoveRemoteRegions({region_.id});
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_TRUE(future.get().ok());
  ExpectLocal(0, 65536, 1);
  EXPECT_EQ(PostAndWait(Read(0, 16)).code(), absl::StatusCode::kNotFound);
}

TEST_F(GpuShmChannelTest, CloseReportsRequestsWithQueuedCopiesBeforeItReturns) {
  Init(absl::Milliseconds(100));
  ASSERT_TRUE(channel_->AddRemoteRegions({Desc(target_->RegionKey(region_.id))}).ok());
  auto result = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> future = result->get_future();
  PostRequest request = Read(0, 65536);
  request.ops.push_back(
      WireOp{static_cast<std::byte*>(local_.data()) + 65536, region_.id, 65536, 65536, 0});
  channel_->Post(std::move(request), [result](absl::Status s) { result->set_value(s); });
  channel_->Close(absl::UnavailableError("peer went away"));
  // The engine may be torn down once Close returned: nothing may be reported after it.
  ASSERT_EQ(future.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  const absl::Status status = future.get();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("peer went away"));
  EXPECT_EQ(PostAndWait(Read(0, 16)).code(), absl::StatusCode::kUnavailable);
}

// Memory the runtime cannot export (no IPC handle) is declined, not an error: the engine keeps
// it registered with its other transports, and the empty key routes peers to them.
TEST(GpuShmDeclineTest, MemoryWithoutAnIpcHandleIsDeclined) {
  kvwire::testing::EmulatedGpu emulated({.ipc = false});
  FakeTargetHooks hooks{OnePeer(kToken, kPeer)};
  ShmTransportOptions options;
  options.engine_name = "no-ipc";
  options.gpu_runtime = &emulated.runtime();
  auto transport = CreateShmTransport(options, &hooks);
  ASSERT_TRUE(transport.ok()) << transport.status();
  EXPECT_TRUE((*transport)->caps().gpu_memory);
  auto device = gpu::DeviceBuffer::Allocate(emulated.runtime(), 0, 1 << 16);
  ASSERT_TRUE(device.ok()) << device.status();
  LocalRegion region;
  region.id = 7;
  region.base = static_cast<std::byte*>(device->data());
  region.length = device->size();
  region.kind = MemoryKind::kGpu;
  region.gpu_device = 0;
  region.gpu_allocation_base = region.base;
  region.gpu_allocation_size = device->size();
  EXPECT_TRUE((*transport)->RegisterRegion(region).ok());
  EXPECT_EQ((*transport)->RegionKey(region.id), "");
  (*transport)->DeregisterRegion(region.id);
  (*transport)->Shutdown();
}

TEST(GpuShmNoRuntimeTest, WithoutARuntimeGpuMemoryIsRefused) {
  FakeTargetHooks hooks{OnePeer(kToken, kPeer)};
  ShmTransportOptions options;
  options.engine_name = "no-gpu";
  auto transport = CreateShmTransport(options, &hooks);
  ASSERT_TRUE(transport.ok()) << transport.status();
  EXPECT_FALSE((*transport)->caps().gpu_memory);
  options.gpu_runtime = &gpu::NoneRuntime();
  auto none = CreateShmTransport(options, &hooks);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE((*none)->caps().gpu_memory);
  std::vector<std::byte> memory(4096);
  LocalRegion region;
  region.id = 1;
  region.base = memory.data();
  region.length = memory.size();
  region.kind = MemoryKind::kGpu;
  region.gpu_device = 0;
  region.gpu_allocation_base = memory.data();
  region.gpu_allocation_size = memory.size();
  absl::Status registered = (*transport)->RegisterRegion(region);
  EXPECT_THAT(registered.message(), HasSubstr("no GPU runtime"));
}

}  // namespace
}  // namespace kvwire::transport
