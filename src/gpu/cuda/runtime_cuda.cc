// CUDA backend: the CUDA runtime API (linked statically; it loads libcuda.so.1 on first use)
// mapped onto DeviceRuntime, plus the driver calls that pointer ranges and dma-buf export need,
// resolved at run time through cudaGetDriverEntryPointByVersion so that nothing links against
// libcuda.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <mutex>
#include <unistd.h>

#include "absl/strings/str_cat.h"

#include "src/gpu/device_runtime.h"
#include "src/gpu/gpu_config.h"
#include "src/gpu/kernels/kernels.h"

namespace kvwire::gpu {
namespace {

// Driver entry points; null when the driver (or this CUDA version) lacks them.
struct Driver {
  using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
#if KVWIRE_GPU_CUDA_HAS_DMABUF
  using GetHandleFn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType,
                                   unsigned long long);
#else
  using GetHandleFn = void*;  // this CUDA's headers have no dma-buf export
#endif
  using DeviceGetAttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);
  using GetErrorStringFn = CUresult (*)(CUresult, const char**);
  GetAddressRangeFn get_address_range = nullptr;
  GetHandleFn get_handle = nullptr;
  DeviceGetAttributeFn device_get_attribute = nullptr;
  GetErrorStringFn get_error_string = nullptr;
};

template <typename Fn>
void Resolve(const char* symbol, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &q);
#else  // ByVersion came with CUDA 12.5; before it, the (later deprecated) unversioned call
  const cudaError_t e = cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &q);
#endif
  if (e == cudaSuccess && q == cudaDriverEntryPointSuccess) {
    *fn = reinterpret_cast<Fn>(p);
  }
}

const Driver& GetDriver() {
  static std::once_flag once;
  static Driver driver;
  std::call_once(once, [] {
    Resolve("cuMemGetAddressRange", &driver.get_address_range);
    Resolve("cuMemGetHandleForAddressRange", &driver.get_handle);
    Resolve("cuDeviceGetAttribute", &driver.device_get_attribute);
    Resolve("cuGetErrorString", &driver.get_error_string);
    (void)cudaGetLastError();
  });
  return driver;
}

absl::Status DriverError(CUresult r, const char* what) {
  const char* text = nullptr;
  if (GetDriver().get_error_string == nullptr ||
      GetDriver().get_error_string(r, &text) != CUDA_SUCCESS) {
    text = "unknown driver error";
  }
  return absl::InternalError(
      absl::StrCat("kvwire gpu: ", what, ": CUresult ", static_cast<int>(r), ": ", text));
}

struct CudaApi {
  using Error = cudaError_t;
  using StreamT = cudaStream_t;
  using EventT = cudaEvent_t;
  using IpcT = cudaIpcMemHandle_t;
  using Props = cudaDeviceProp;
  static constexpr Backend kBackend = Backend::kCuda;
  static constexpr const char* kName = "CUDA";
  static constexpr const char* kPrefix = "cuda";
  static constexpr const char* kHostAllocCall = "cudaHostAlloc";
  static constexpr const char* kFreeHostCall = "cudaFreeHost";
  static constexpr Error kSuccess = cudaSuccess;
  static constexpr Error kNotReady = cudaErrorNotReady;

  static absl::StatusCode CodeOf(Error e) {
    switch (e) {
      case cudaErrorMemoryAllocation:
        return absl::StatusCode::kResourceExhausted;
      case cudaErrorInvalidValue:
      case cudaErrorInvalidDevice:
      case cudaErrorInvalidDevicePointer:
      case cudaErrorInvalidResourceHandle:
        return absl::StatusCode::kInvalidArgument;
      case cudaErrorNoDevice:
      case cudaErrorInsufficientDriver:
        return absl::StatusCode::kUnavailable;
      default:
        return absl::StatusCode::kInternal;
    }
  }
  static std::string ErrorText(Error e) {
    return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  }

  static Error GetDeviceCount(int* n) { return cudaGetDeviceCount(n); }
  static Error GetDeviceProperties(Props* p, int d) { return cudaGetDeviceProperties(p, d); }
  static Error DeviceGetPCIBusId(char* bus, int len, int d) {
    return cudaDeviceGetPCIBusId(bus, len, d);
  }
  static Error SetDevice(int d) { return cudaSetDevice(d); }
  static Error Malloc(void** p, size_t n) { return cudaMalloc(p, n); }
  static Error Free(void* p) { return cudaFree(p); }
  static Error HostAlloc(void** p, size_t n) { return cudaHostAlloc(p, n, cudaHostAllocPortable); }
  static Error FreeHost(void* p) { return cudaFreeHost(p); }
  static Error StreamCreateNonBlocking(StreamT* s) {
    return cudaStreamCreateWithFlags(s, cudaStreamNonBlocking);
  }
  static Error StreamDestroy(StreamT s) { return cudaStreamDestroy(s); }
  static Error StreamSynchronize(StreamT s) { return cudaStreamSynchronize(s); }
  static Error EventCreateNoTiming(EventT* e) {
    return cudaEventCreateWithFlags(e, cudaEventDisableTiming);
  }
  static Error EventDestroy(EventT e) { return cudaEventDestroy(e); }
  static Error EventRecord(EventT e, StreamT s) { return cudaEventRecord(e, s); }
  static Error StreamWaitEvent(StreamT s, EventT e) { return cudaStreamWaitEvent(s, e, 0); }
  static Error EventQuery(EventT e) { return cudaEventQuery(e); }
  static Error EventSynchronize(EventT e) { return cudaEventSynchronize(e); }
  static Error GetLastError() { return cudaGetLastError(); }
  static Error MemcpyAsync(void* dst, const void* src, size_t n, StreamT s) {
    return cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s);
  }
  static Error IpcGetMemHandle(IpcT* h, void* p) { return cudaIpcGetMemHandle(h, p); }
  static Error IpcOpenMemHandle(void** p, IpcT h) {
    return cudaIpcOpenMemHandle(p, h, cudaIpcMemLazyEnablePeerAccess);
  }
  static Error IpcCloseMemHandle(void* p) { return cudaIpcCloseMemHandle(p); }
  static Error EncodeKvRecords(const KvEncodeArgs& args, void* stream) {
    return static_cast<Error>(cuda_kernels::EncodeKvRecords(args, stream));
  }

  // cudart reports a missing driver as "insufficient driver"; say which it is.
  static std::string NoDeviceHint() {
    void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (h != nullptr) {
      dlclose(h);
      return "";
    }
    const char* err = dlerror();
    return absl::StrCat("; NVIDIA driver not loadable: ", err ? err : "libcuda.so.1");
  }

  static void AddDeviceInfo(int device, DeviceInfo* info) {
    if (info->numa_node < 0) {
      int node = -1;
      if (cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, device) == cudaSuccess) {
        info->numa_node = node < 0 ? -1 : node;
      }
      (void)cudaGetLastError();
    }
#if KVWIRE_GPU_CUDA_HAS_DMABUF
    const Driver& d = GetDriver();
    if (d.get_handle != nullptr && d.device_get_attribute != nullptr) {
      int supported = 0;
      if (d.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device) ==
          CUDA_SUCCESS) {
        info->dma_buf = supported != 0;
      }
    }
#endif
  }

  static absl::StatusOr<int> PointerDevice(const void* ptr) {
    cudaPointerAttributes attr{};
    if (Error e = cudaPointerGetAttributes(&attr, ptr); e != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::Status(CodeOf(e),
                          absl::StrCat("kvwire gpu: cudaPointerGetAttributes: ", ErrorText(e)));
    }
    if (attr.type != cudaMemoryTypeDevice) {
      return absl::InvalidArgumentError(
          absl::StrCat("kvwire gpu: 0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                       " is not CUDA device memory (cudaPointerGetAttributes type ",
                       static_cast<int>(attr.type), ")"));
    }
    return attr.device;
  }

  static absl::StatusOr<PointerInfo> AllocationRange(const void* ptr) {
    const Driver& d = GetDriver();
    if (d.get_address_range == nullptr) {
      return absl::UnimplementedError(
          "kvwire gpu: cuMemGetAddressRange is not available from this CUDA driver");
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    if (CUresult r = d.get_address_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
        r != CUDA_SUCCESS) {
      return DriverError(r, "cuMemGetAddressRange");
    }
    return PointerInfo{-1, reinterpret_cast<void*>(base), size};
  }

  static absl::StatusOr<DmaBufRange> ExportDmaBuf(const void* ptr, size_t bytes) {
#if KVWIRE_GPU_CUDA_HAS_DMABUF
    const Driver& d = GetDriver();
    if (d.get_handle == nullptr || d.get_address_range == nullptr) {
      return absl::UnimplementedError(
          "kvwire gpu: cuMemGetHandleForAddressRange is not available from this CUDA driver");
    }
    // Export the whole allocation around [ptr, ptr+bytes), page-aligned as the driver wants;
    // the caller registers its sub-range at `offset` within the dma-buf.
    absl::StatusOr<PointerInfo> range = AllocationRange(ptr);
    if (!range.ok()) return range.status();
    const auto base = reinterpret_cast<CUdeviceptr>(range->allocation_base);
    const auto p = reinterpret_cast<CUdeviceptr>(ptr);
    if (p + bytes > base + range->allocation_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("kvwire gpu: dma-buf range of ", bytes, " B at offset ", p - base,
                       " runs past its allocation of ", range->allocation_size, " B"));
    }
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const CUdeviceptr start = base & ~(page - 1);
    const uint64_t size = (base + range->allocation_size - start + page - 1) & ~(page - 1);
    int fd = -1;
    if (CUresult r = d.get_handle(&fd, start, size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
        r != CUDA_SUCCESS) {
      return DriverError(r, "cuMemGetHandleForAddressRange(DMA_BUF_FD)");
    }
    return DmaBufRange{fd, p - start, size};
#else
    (void)ptr;
    (void)bytes;
    return absl::UnimplementedError(
        "kvwire gpu: this build's cuda.h has no cuMemGetHandleForAddressRange (CUDA < 11.7)");
#endif
  }
  static void CloseDmaBuf(int fd) { close(fd); }
};

}  // namespace

Runtime& CudaRuntime() {
  static DeviceRuntime<CudaApi> rt;
  return rt;
}

}  // namespace kvwire::gpu
