// The rdma transport's GPU registration logic without verbs: which path a region takes, the
// reason it reports, the ibv_reg_dmabuf_mr arguments of a sub-range, the dma-buf fd's life.
#include "transport/rdma/rdma_gpu_mr.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace kvwire::transport::rdma {
namespace {

using ::testing::HasSubstr;

absl::Status Refused(const char* call, int err) {
  return absl::UnavailableError(absl::StrCat(call, ": ", std::strerror(err)));
}

TEST(ChooseGpuMr, DmaBufFirstAndPeerMemoryNotTried) {
  int dmabuf_calls = 0, peer_calls = 0;
  auto choice = ChooseGpuMr(
      absl::OkStatus(),
      [&] {
        ++dmabuf_calls;
        return absl::OkStatus();
      },
      [&] {
        ++peer_calls;
        return absl::OkStatus();
      });
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->path, GpuMrPath::kDmaBuf);
  EXPECT_STREQ(GpuMrPathName(choice->path), "dma-buf");
  EXPECT_THAT(choice->reason, HasSubstr("peer memory not needed"));
  EXPECT_EQ(dmabuf_calls, 1);
  EXPECT_EQ(peer_calls, 0);
}

TEST(ChooseGpuMr, RefusedDmaBufFallsBackToPeerMemoryNamingTheErrno) {
  int peer_calls = 0;
  auto choice = ChooseGpuMr(
      absl::OkStatus(), [] { return Refused("ibv_reg_dmabuf_mr", EOPNOTSUPP); },
      [&] {
        ++peer_calls;
        return absl::OkStatus();
      });
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->path, GpuMrPath::kPeerMemory);
  EXPECT_STREQ(GpuMrPathName(choice->path), "peer-memory");
  EXPECT_THAT(choice->reason,
              HasSubstr(absl::StrCat("ibv_reg_dmabuf_mr: ", std::strerror(EOPNOTSUPP))));
  EXPECT_EQ(peer_calls, 1);
}

TEST(ChooseGpuMr, NoExportSkipsTheDmaBufAttempt) {
  int dmabuf_calls = 0;
  auto choice = ChooseGpuMr(
      absl::UnimplementedError("cuMemGetHandleForAddressRange is not available"),
      [&] {
        ++dmabuf_calls;
        return absl::OkStatus();
      },
      [] { return absl::OkStatus(); });
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->path, GpuMrPath::kPeerMemory);
  EXPECT_THAT(choice->reason, HasSubstr("no dma-buf from the GPU runtime"));
  EXPECT_THAT(choice->reason, HasSubstr("cuMemGetHandleForAddressRange is not available"));
  EXPECT_EQ(dmabuf_calls, 0);
}

TEST(ChooseGpuMr, BothFailingNamesBothPathsAndReasons) {
  auto choice = ChooseGpuMr(
      absl::OkStatus(), [] { return Refused("ibv_reg_dmabuf_mr", EOPNOTSUPP); },
      [] { return Refused("ibv_reg_mr on the device pointer", EFAULT); });
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string m(choice.status().message());
  EXPECT_THAT(m, HasSubstr("dma-buf path"));
  EXPECT_THAT(m, HasSubstr(absl::StrCat("ibv_reg_dmabuf_mr: ", std::strerror(EOPNOTSUPP))));
  EXPECT_THAT(m, HasSubstr("peer-memory path"));
  EXPECT_THAT(m,
              HasSubstr(absl::StrCat("ibv_reg_mr on the device pointer: ", std::strerror(EFAULT))));

  auto no_export = ChooseGpuMr(
      absl::UnimplementedError("no dma-buf export in this runtime"),
      [] { return absl::OkStatus(); },
      [] { return Refused("ibv_reg_mr on the device pointer", EFAULT); });
  ASSERT_FALSE(no_export.ok());
  EXPECT_THAT(std::string(no_export.status().message()),
              HasSubstr("no dma-buf export in this runtime"));
}

// A region that starts inside its allocation: the dma-buf covers the (page-aligned)
// allocation, the MR covers the region at its offset within it, addressed by its own VA.
TEST(DmaBufArgsFor, SubRangeUsesTheOffsetWithinTheDmaBufAndTheRegionsAddress) {
  alignas(4096) static std::byte allocation[64 << 10];
  const uint64_t offset = 3 * 4096 + 256;  // not page-aligned
  const std::byte* base = allocation + offset;
  const gpu::DmaBufRange range{7, offset, sizeof(allocation)};
  auto args = DmaBufArgsFor(range, base, 8192);
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(args->fd, 7);
  EXPECT_EQ(args->offset, offset);
  EXPECT_EQ(args->length, 8192u);
  EXPECT_EQ(args->iova, reinterpret_cast<uint64_t>(base));

  // Up to the end of the dma-buf fits; one byte more does not.
  EXPECT_TRUE(DmaBufArgsFor(range, base, sizeof(allocation) - offset).ok());
  auto past = DmaBufArgsFor(range, base, sizeof(allocation) - offset + 1);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  auto outside =
      DmaBufArgsFor(gpu::DmaBufRange{7, sizeof(allocation) + 1, sizeof(allocation)}, base, 1);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
}

// Only the dma-buf calls of gpu::Runtime matter here; the rest is never called.
class DmaBufOnlyRuntime : public gpu::Runtime {
 public:
  gpu::Backend backend() const override { return gpu::Backend::kEmulated; }
  absl::StatusOr<int> DeviceCount() override { return 1; }
  absl::StatusOr<gpu::DeviceInfo> GetDeviceInfo(int) override { return Unused(); }
  absl::StatusOr<void*> Allocate(int, size_t) override { return Unused(); }
  void Free(int, void*) override {}
  absl::StatusOr<void*> AllocatePinnedHost(int, size_t) override { return Unused(); }
  void FreePinnedHost(void*) override {}
  absl::StatusOr<gpu::PointerInfo> QueryPointer(const void*) override { return Unused(); }
  absl::StatusOr<void*> CreateStream(int) override { return Unused(); }
  void DestroyStream(int, void*) override {}
  absl::Status SynchronizeStream(int, void*) override { return Unused(); }
  absl::Status CopyAsync(int, void*, const void*, size_t, void*) override { return Unused(); }
  absl::StatusOr<void*> CreateEvent(int) override { return Unused(); }
  void DestroyEvent(int, void*) override {}
  absl::Status RecordEvent(int, void*, void*) override { return Unused(); }
  absl::StatusOr<bool> EventDone(int, void*) override { return Unused(); }
  absl::Status SynchronizeEvent(int, void*) override { return Unused(); }
  absl::Status StreamWaitEvent(int, void*, void*) override { return Unused(); }
  absl::StatusOr<gpu::IpcHandle> ExportIpc(int, void*) override { return Unused(); }
  absl::StatusOr<void*> OpenIpc(int, const gpu::IpcHandle&) override { return Unused(); }
  void CloseIpc(int, void*) override {}
  absl::Status EncodeKvRecords(int, const gpu::KvEncodeArgs&, void*) override { return Unused(); }

  absl::StatusOr<gpu::DmaBufRange> ExportDmaBuf(int device, const void* ptr,
                                                size_t bytes) override {
    if (fail) return absl::UnimplementedError("no dma-buf here");
    last_device = device;
    last_ptr = ptr;
    last_bytes = bytes;
    const int fd = memfd_create("dmabuf-test", MFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(std::strerror(errno));
    return gpu::DmaBufRange{fd, 256, 1 << 20};
  }
  void CloseDmaBuf(int fd) override {
    closed.push_back(fd);
    close(fd);
  }

  bool fail = false;
  int last_device = -1;
  const void* last_ptr = nullptr;
  size_t last_bytes = 0;
  std::vector<int> closed;

 private:
  static absl::Status Unused() { return absl::UnimplementedError("not used by this test"); }
};

bool FdOpen(int fd) { return fcntl(fd, F_GETFD) != -1; }

TEST(ExportedDmaBuf, ExportsTheRegionAndClosesItsFdOnceThroughTheRuntime) {
  DmaBufOnlyRuntime rt;
  static std::byte memory[4096];
  int fd = -1;
  {
    auto buf = ExportedDmaBuf::Export(rt, 3, memory + 256, 1000);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_EQ(rt.last_device, 3);
    EXPECT_EQ(rt.last_ptr, memory + 256);
    EXPECT_EQ(rt.last_bytes, 1000u);
    ASSERT_TRUE(buf->valid());
    fd = buf->range().fd;
    EXPECT_EQ(buf->range().offset, 256u);
    ExportedDmaBuf moved = std::move(*buf);
    EXPECT_FALSE(buf->valid());
    EXPECT_TRUE(FdOpen(fd));
    EXPECT_TRUE(rt.closed.empty());
    ExportedDmaBuf assigned;
    assigned = std::move(moved);
    EXPECT_TRUE(FdOpen(fd));
    EXPECT_TRUE(rt.closed.empty());
  }
  EXPECT_EQ(rt.closed, std::vector<int>{fd});
  EXPECT_FALSE(FdOpen(fd));

  rt.fail = true;
  auto none = ExportedDmaBuf::Export(rt, 0, memory, 16);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(rt.closed.size(), 1u);
}

TEST(ExportedDmaBuf, ResetClosesEarly) {
  DmaBufOnlyRuntime rt;
  static std::byte memory[64];
  auto buf = ExportedDmaBuf::Export(rt, 0, memory, sizeof(memory));
  ASSERT_TRUE(buf.ok()) << buf.status();
  const int fd = buf->range().fd;
  buf->Reset();
  EXPECT_FALSE(buf->valid());
  EXPECT_FALSE(FdOpen(fd));
  EXPECT_EQ(rt.closed.size(), 1u);
}

}  // namespace
}  // namespace kvwire::transport::rdma
