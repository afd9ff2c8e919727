// HIP backend (ROCm): the HIP runtime API (libamdhip64) mapped onto DeviceRuntime. dma-buf
// export uses hsa_amd_portable_export_dmabuf or hipMemGetHandleForAddressRange when configure
// found them in the headers (ROCm >= 5.7 / 6.x); Debian 12's ROCm 5.2 has neither, and then GPU
// memory over rdma needs the peer-memory path (ibv_reg_mr on the device pointer).
#include <cstring>
#include <unistd.h>

#include <hip/hip_runtime_api.h>

#include "absl/strings/str_cat.h"

#include "src/gpu/device_runtime.h"
#include "src/gpu/gpu_config.h"
#include "src/gpu/kernels/kernels.h"

#if KVWIRE_GPU_HIP_HAS_HSA_DMABUF
#include <hsa/hsa_ext_amd.h>
#endif

namespace kvwire::gpu {
namespace {

struct HipApi {
  using Error = hipError_t;
  using StreamT = hipStream_t;
  using EventT = hipEvent_t;
  using IpcT = hipIpcMemHandle_t;
  using Props = hipDeviceProp_t;
  static constexpr Backend kBackend = Backend::kHip;
  static constexpr const char* kName = "HIP";
  static constexpr const char* kPrefix = "hip";
  static constexpr const char* kHostAllocCall = "hipHostMalloc";
  static constexpr const char* kFreeHostCall = "hipHostFree";
  static constexpr Error kSuccess = hipSuccess;
  static constexpr Error kNotReady = hipErrorNotReady;

  static absl::StatusCode CodeOf(Error e) {
    switch (e) {
      case hipErrorOutOfMemory:
        return absl::StatusCode::kResourceExhausted;
      case hipErrorInvalidValue:
      case hipErrorInvalidDevice:
      case hipErrorInvalidDevicePointer:
      case hipErrorInvalidHandle:
        return absl::StatusCode::kInvalidArgument;
      case hipErrorNoDevice:
      case hipErrorInsufficientDriver:
        return absl::StatusCode::kUnavailable;
      default:
        return absl::StatusCode::kInternal;
    }
  }
  static std::string ErrorText(Error e) {
    const std::string name = hipGetErrorName(e), text = hipGetErrorString(e);
    // Some HIP releases return the name as the description too.
    return text == name ? name : absl::StrCat(name, ": ", text);
  }

  static Error GetDeviceCount(int* n) { return hipGetDeviceCount(n); }
  static Error GetDeviceProperties(Props* p, int d) { return hipGetDeviceProperties(p, d); }
  static Error DeviceGetPCIBusId(char* bus, int len, int d) {
    return hipDeviceGetPCIBusId(bus, len, d);
  }
  static Error SetDevice(int d) { return hipSetDevice(d); }
  static Error Malloc(void** p, size_t n) { return hipMalloc(p, n); }
  static Error Free(void* p) { return hipFree(p); }
  static Error HostAlloc(void** p, size_t n) { return hipHostMalloc(p, n, hipHostMallocPortable); }
  static Error FreeHost(void* p) { return hipHostFree(p); }
  static Error StreamCreateNonBlocking(StreamT* s) {
    return hipStreamCreateWithFlags(s, hipStreamNonBlocking);
  }
  static Error StreamDestroy(StreamT s) { return hipStreamDestroy(s); }
  static Error StreamSynchronize(StreamT s) { return hipStreamSynchronize(s); }
  static Error EventCreateNoTiming(EventT* e) {
    return hipEventCreateWithFlags(e, hipEventDisableTiming);
  }
  static Error EventDestroy(EventT e) { return hipEventDestroy(e); }
  static Error EventRecord(EventT e, StreamT s) { return hipEventRecord(e, s); }
  static Error StreamWaitEvent(StreamT s, EventT e) { return hipStreamWaitEvent(s, e, 0); }
  static Error EventQuery(EventT e) { return hipEventQuery(e); }
  static Error EventSynchronize(EventT e) { return hipEventSynchronize(e); }
  static Error GetLastError() { return hipGetLastError(); }
  static Error MemcpyAsync(void* dst, const void* src, size_t n, StreamT s) {
    return hipMemcpyAsync(dst, src, n, hipMemcpyDefault, s);
  }
  static Error IpcGetMemHandle(IpcT* h, void* p) { return hipIpcGetMemHandle(h, p); }
  static Error IpcOpenMemHandle(void** p, IpcT h) {
    return hipIpcOpenMemHandle(p, h, hipIpcMemLazyEnablePeerAccess);
  }
  static Error IpcCloseMemHandle(void* p) { return hipIpcCloseMemHandle(p); }
  static Error EncodeKvRecords(const KvEncodeArgs& args, void* stream) {
    return static_cast<Error>(hip_kernels::EncodeKvRecords(args, stream));
  }

  static std::string NoDeviceHint() {
    return access("/dev/kfd", F_OK) == 0 ? "" : "; no /dev/kfd (amdgpu driver)";
  }

  static void AddDeviceInfo(int, DeviceInfo* info) {
    info->dma_buf = KVWIRE_GPU_HIP_HAS_HSA_DMABUF || KVWIRE_GPU_HIP_HAS_HIP_DMABUF;
  }

  static absl::StatusOr<int> PointerDevice(const void* ptr) {
    hipPointerAttribute_t attr{};
    if (Error e = hipPointerGetAttributes(&attr, ptr); e != hipSuccess) {
      (void)hipGetLastError();
      return absl::Status(CodeOf(e),
                          absl::StrCat("kvwire gpu: hipPointerGetAttributes: ", ErrorText(e)));
    }
    // ROCm 5.x names the field memoryType, 6.x type; both are the first member.
    hipMemoryType type{};
    std::memcpy(&type, &attr, sizeof type);
    if (type != hipMemoryTypeDevice) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kvwire gpu: 0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
          " is not HIP device memory (hipPointerGetAttributes type ", static_cast<int>(type), ")"));
    }
    return attr.device;
  }

  static absl::StatusOr<PointerInfo> AllocationRange(const void* ptr) {
    hipDeviceptr_t base = nullptr;
    size_t size = 0;
    if (Error e = hipMemGetAddressRange(&base, &size, const_cast<void*>(ptr)); e != hipSuccess) {
      return absl::Status(CodeOf(e),
                          absl::StrCat("kvwire gpu: hipMemGetAddressRange: ", ErrorText(e)));
    }
    return PointerInfo{-1, base, size};
  }

  static absl::StatusOr<DmaBufRange> ExportDmaBuf(const void* ptr, size_t bytes) {
#if KVWIRE_GPU_HIP_HAS_HSA_DMABUF
    int fd = -1;
    uint64_t offset = 0;
    if (hsa_status_t r = hsa_amd_portable_export_dmabuf(ptr, bytes, &fd, &offset);
        r != HSA_STATUS_SUCCESS) {
      return absl::InternalError(
          absl::StrCat("kvwire gpu: hsa_amd_portable_export_dmabuf: hsa_status ", r));
    }
    return DmaBufRange{fd, offset, offset + bytes};
#elif KVWIRE_GPU_HIP_HAS_HIP_DMABUF
    // Whole pages around the range; the caller's range sits at `offset` within them.
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t start = p & ~(page - 1);
    const uint64_t size = (p + bytes - start + page - 1) & ~(page - 1);
    int fd = -1;
    if (Error e = hipMemGetHandleForAddressRange(&fd, reinterpret_cast<hipDeviceptr_t>(start), size,
                                                 hipMemRangeHandleTypeDmaBufFd, 0);
        e != hipSuccess) {
      return absl::Status(
          CodeOf(e), absl::StrCat("kvwire gpu: hipMemGetHandleForAddressRange: ", ErrorText(e)));
    }
    return DmaBufRange{fd, p - start, size};
#else
    (void)ptr;
    (void)bytes;
    return absl::UnimplementedError(
        "kvwire gpu: no dma-buf export in this HIP (hsa_amd_portable_export_dmabuf and "
        "hipMemGetHandleForAddressRange were not in its headers at configure time)");
#endif
  }
  static void CloseDmaBuf(int fd) {
#if KVWIRE_GPU_HIP_HAS_HSA_DMABUF
    hsa_amd_portable_close_dmabuf(fd);
#else
    close(fd);
#endif
  }
};

}  // namespace

Runtime& HipRuntime() {
  static DeviceRuntime<HipApi> rt;
  return rt;
}

}  // namespace kvwire::gpu
