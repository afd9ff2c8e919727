// The host and device KV executors.
#include "examples/dsv4/model/gpu/kv_executor.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

#include "examples/dsv4/model/gpu/host_driver.h"
#include "examples/dsv4/model/gpu/kernels.h"
#include "src/gpu/kv_record_cpu.h"

namespace dsv4::gpu {
namespace {

class HostBuffer : public KvExecutor::Buffer {
 public:
  explicit HostBuffer(size_t bytes) : bytes_(bytes) {}
  void* data() const override { return const_cast<uint8_t*>(bytes_.data()); }

 private:
  std::vector<uint8_t> bytes_;
};

class HostExecutor : public KvExecutor {
 public:
  const char* name() const override { return "host"; }
  int device() const override { return -1; }
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override {
    return std::make_unique<HostBuffer>(bytes);
  }
  absl::Status Upload(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Download(void* dst, const void* src, size_t bytes) override {
    return Upload(dst, src, bytes);
  }
  absl::Status EncodeKvRecords(const kvwire::gpu::KvEncodeArgs& args) override {
    return kvwire::gpu::EncodeKvRecordsCpu(args);
  }
  absl::Status AttentionLogits(const AttentionArgs& args) override {
    AttentionLogitsHost(args);
    return absl::OkStatus();
  }
  absl::Status AttentionOutput(const AttentionArgs& args) override {
    AttentionOutputHost(args);
    return absl::OkStatus();
  }
};

// The attention launchers of libkvwire's backend (only that backend's objects are linked
// into dsv4_model; see CMakeLists.txt).
#if DSV4_GPU_KERNELS_CUDA
namespace launch = cuda_kernels;
constexpr kvwire::gpu::Backend kKernelBackend = kvwire::gpu::Backend::kCuda;
#elif DSV4_GPU_KERNELS_HIP
namespace launch = hip_kernels;
constexpr kvwire::gpu::Backend kKernelBackend = kvwire::gpu::Backend::kHip;
#else
constexpr kvwire::gpu::Backend kKernelBackend = kvwire::gpu::Backend::kNone;
#endif

class DeviceBufferHolder : public KvExecutor::Buffer {
 public:
  explicit DeviceBufferHolder(kvwire::gpu::DeviceBuffer buffer) : buffer_(std::move(buffer)) {}
  void* data() const override { return buffer_.data(); }

 private:
  kvwire::gpu::DeviceBuffer buffer_;
};

class DeviceExecutor : public KvExecutor {
 public:
  DeviceExecutor(kvwire::gpu::Runtime& rt, int device, kvwire::gpu::Stream stream)
      : rt_(rt), device_(device), stream_(std::move(stream)) {}
  const char* name() const override { return kvwire::gpu::BackendName(rt_.backend()); }
  int device() const override { return device_; }
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override {
    absl::StatusOr<kvwire::gpu::DeviceBuffer> b =
        kvwire::gpu::DeviceBuffer::Allocate(rt_, device_, std::max<size_t>(bytes, 1));
    if (!b.ok()) return b.status();
    return std::make_unique<DeviceBufferHolder>(std::move(*b));
  }
  absl::Status Upload(void* dst, const void* src, size_t bytes) override {
    return bytes == 0 ? absl::OkStatus() : stream_.Copy(dst, src, bytes);
  }
  absl::Status Download(void* dst, const void* src, size_t bytes) override {
    return bytes == 0 ? absl::OkStatus() : stream_.Copy(dst, src, bytes);
  }
  absl::Status EncodeKvRecords(const kvwire::gpu::KvEncodeArgs& args) override {
    if (absl::Status s = kvwire::gpu::ValidateKvEncodeArgs(args); !s.ok()) return s;
    if (absl::Status s = stream_.EncodeKvRecords(args); !s.ok()) return s;
    return stream_.Synchronize();
  }
  absl::Status AttentionLogits(const AttentionArgs& args) override {
#if DSV4_GPU_KERNELS_CUDA || DSV4_GPU_KERNELS_HIP
    return Launched(launch::AttentionLogits(device_, args, stream_.native()), "AttentionLogits");
#else
    return NoKernels();
#endif
  }
  absl::Status AttentionOutput(const AttentionArgs& args) override {
#if DSV4_GPU_KERNELS_CUDA || DSV4_GPU_KERNELS_HIP
    return Launched(launch::AttentionOutput(device_, args, stream_.native()), "AttentionOutput");
#else
    return NoKernels();
#endif
  }

 private:
  absl::Status Launched(int code, const char* what) {
#if DSV4_GPU_KERNELS_CUDA || DSV4_GPU_KERNELS_HIP
    if (code != 0) {
      return absl::InternalError(absl::StrCat("dsv4 gpu: ", what, " kernel launch on device ",
                                              device_, ": ", launch::ErrorName(code)));
    }
#endif
    return stream_.Synchronize();
  }
  static absl::Status NoKernels() {
    return absl::UnimplementedError("dsv4 gpu: this build has no attention kernels");
  }

  kvwire::gpu::Runtime& rt_;
  const int device_;
  kvwire::gpu::Stream stream_;
};

}  // namespace

std::unique_ptr<KvExecutor> MakeHostExecutor() { return std::make_unique<HostExecutor>(); }

absl::StatusOr<std::unique_ptr<KvExecutor>> MakeDeviceExecutor(kvwire::gpu::Runtime& runtime,
                                                               int device) {
  absl::StatusOr<int> count = runtime.DeviceCount();
  if (!count.ok()) return count.status();
  if (device < 0 || device >= *count) {
    return absl::InvalidArgumentError(absl::StrCat("dsv4 gpu: device ", device, " of ",
                                                   kvwire::gpu::BackendName(runtime.backend()),
                                                   " does not exist (", *count, " devices)"));
  }
  // The kernels launch through their own runtime's API on this runtime's streams and memory.
  if (runtime.backend() != kKernelBackend) {
    return absl::UnimplementedError(
        absl::StrCat("dsv4 gpu: this build's attention kernels are for ",
                     kvwire::gpu::BackendName(kKernelBackend), ", the runtime is ",
                     kvwire::gpu::BackendName(runtime.backend())));
  }
  absl::StatusOr<kvwire::gpu::Stream> stream = kvwire::gpu::Stream::Create(runtime, device);
  if (!stream.ok()) return stream.status();
  return std::make_unique<DeviceExecutor>(runtime, device, std::move(*stream));
}

}  // namespace dsv4::gpu
