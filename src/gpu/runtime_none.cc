// The runtime of a build without CUDA or HIP: the engine keeps working with host memory, and
// every GPU call says in one line why it cannot.
#include <atomic>

#include "absl/strings/str_cat.h"

#include "src/gpu/gpu_config.h"
#include "src/gpu/runtime.h"

namespace kvwire::gpu {
namespace {

class NoneRuntimeImpl final : public Runtime {
 public:
  Backend backend() const override { return Backend::kNone; }
  absl::StatusOr<int> DeviceCount() override { return absl::UnavailableError(Why()); }
  absl::StatusOr<DeviceInfo> GetDeviceInfo(int) override { return Fail(); }
  absl::StatusOr<void*> Allocate(int, size_t) override { return Fail(); }
  void Free(int, void*) override {}
  absl::StatusOr<void*> AllocatePinnedHost(int, size_t) override { return Fail(); }
  void FreePinnedHost(void*) override {}
  absl::StatusOr<PointerInfo> QueryPointer(const void*) override { return Fail(); }
  absl::StatusOr<void*> CreateStream(int) override { return Fail(); }
  void DestroyStream(int, void*) override {}
  absl::Status SynchronizeStream(int, void*) override { return Fail(); }
  absl::StatusOr<void*> CreateEvent(int) override { return Fail(); }
  void DestroyEvent(int, void*) override {}
  absl::Status RecordEvent(int, void*, void*) override { return Fail(); }
  absl::Status StreamWaitEvent(int, void*, void*) override { return Fail(); }
  absl::StatusOr<bool> EventDone(int, void*) override { return Fail(); }
  absl::Status SynchronizeEvent(int, void*) override { return Fail(); }
  absl::Status CopyAsync(int, void*, const void*, size_t, void*) override { return Fail(); }
  absl::StatusOr<IpcHandle> ExportIpc(int, void*) override { return Fail(); }
  absl::StatusOr<void*> OpenIpc(int, const IpcHandle&) override { return Fail(); }
  void CloseIpc(int, void*) override {}
  absl::StatusOr<DmaBufRange> ExportDmaBuf(int, const void*, size_t) override { return Fail(); }
  void CloseDmaBuf(int) override {}
  absl::Status EncodeKvRecords(int, const KvEncodeArgs&, void*) override { return Fail(); }

 private:
  static std::string Why() {
    return absl::StrCat("kvwire gpu: no GPU runtime in this build (", KVWIRE_GPU_NONE_REASON, ")");
  }
  static absl::Status Fail() { return absl::FailedPreconditionError(Why()); }
};

}  // namespace

Runtime& NoneRuntime() {
  static NoneRuntimeImpl rt;
  return rt;
}

namespace {
std::atomic<Runtime*> default_override{nullptr};
}  // namespace

void SetDefaultRuntime(Runtime* runtime) { default_override.store(runtime); }

Runtime& DefaultRuntime() {
  if (Runtime* r = default_override.load(std::memory_order_acquire)) return *r;
#if KVWIRE_GPU_DEFAULT_CUDA
  return CudaRuntime();
#elif KVWIRE_GPU_DEFAULT_HIP
  return HipRuntime();
#else
  return NoneRuntime();
#endif
}

}  // namespace kvwire::gpu
