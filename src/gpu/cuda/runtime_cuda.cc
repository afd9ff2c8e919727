// CUDA backend: the CUDA runtime API (linked statically; it loads libcuda.so.1 on first use),
// plus the two driver calls dma-buf export needs, resolved at run time through
// cudaGetDriverEntryPointByVersion so that nothing links against libcuda.
#include <cstring>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <mutex>
#include <unistd.h>

#include "absl/strings/str_cat.h"

#include "src/gpu/gpu_config.h"
#include "src/gpu/kernels/kernels.h"
#include "src/gpu/runtime.h"
#include "src/util/log.h"

namespace kvwire::gpu {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes);

std::string ErrorText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}
absl::Status Error(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat("kvwire gpu: ", what, ": ", ErrorText(e));
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
      return absl::InvalidArgumentError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

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
  if (cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess) {
    *fn = reinterpret_cast<Fn>(p);
  }
}

class CudaRuntimeImpl final : public Runtime {
 public:
  Backend backend() const override { return Backend::kCuda; }

  absl::StatusOr<int> DeviceCount() override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n > 0) return n;
    std::string why = e == cudaSuccess ? "0 devices" : ErrorText(e);
    // cudart reports a missing driver as "insufficient driver"; say which it is.
    if (void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL); h == nullptr) {
      const char* err = dlerror();
      absl::StrAppend(&why, "; NVIDIA driver not loadable: ", err ? err : "libcuda.so.1");
    } else {
      dlclose(h);
    }
    return absl::UnavailableError(
        absl::StrCat("kvwire gpu: no CUDA device (cudaGetDeviceCount: ", why, ")"));
  }

  absl::StatusOr<DeviceInfo> GetDeviceInfo(int device) override {
    cudaDeviceProp prop{};
    if (absl::Status s = Error(cudaGetDeviceProperties(&prop, device),
                               absl::StrCat("cudaGetDeviceProperties(", device, ")"));
        !s.ok()) {
      return s;
    }
    DeviceInfo info;
    info.ordinal = device;
    info.name = prop.name;
    info.total_bytes = prop.totalGlobalMem;
    char bus[64] = {};
    if (absl::Status s = Error(cudaDeviceGetPCIBusId(bus, sizeof bus, device),
                               absl::StrCat("cudaDeviceGetPCIBusId(", device, ")"));
        !s.ok()) {
      return s;
    }
    info.pci_bus_id = NormalizePciBusId(bus);
    info.numa_node = NumaNodeOfPciDevice(info.pci_bus_id);
    if (info.numa_node < 0) {
      int node = -1;
      if (cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, device) == cudaSuccess) {
        info.numa_node = node < 0 ? -1 : node;
      }
      (void)cudaGetLastError();
    }
#if KVWIRE_GPU_CUDA_HAS_DMABUF
    const Driver& d = driver();
    if (d.get_handle != nullptr && d.device_get_attribute != nullptr) {
      int supported = 0;
      if (d.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device) ==
          CUDA_SUCCESS) {
        info.dma_buf = supported != 0;
      }
    }
#endif
    return info;
  }

  absl::StatusOr<void*> Allocate(int device, size_t bytes) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    void* p = nullptr;
    if (absl::Status s = Error(cudaMalloc(&p, bytes),
                               absl::StrCat("cudaMalloc(", bytes, " B, device ", device, ")"));
        !s.ok()) {
      return s;
    }
    return p;
  }
  void Free(int device, void* ptr) override {
    LogIfError(SetDevice(device));
    LogIfError(Error(cudaFree(ptr), "cudaFree"));
  }

  absl::StatusOr<void*> AllocatePinnedHost(size_t bytes) override {
    void* p = nullptr;
    if (absl::Status s = Error(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
                               absl::StrCat("cudaHostAlloc(", bytes, " B)"));
        !s.ok()) {
      return s;
    }
    return p;
  }
  void FreePinnedHost(void* ptr) override { LogIfError(Error(cudaFreeHost(ptr), "cudaFreeHost")); }

  absl::StatusOr<PointerInfo> QueryPointer(const void* ptr) override {
    cudaPointerAttributes attr{};
    if (absl::Status s = Error(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
        !s.ok()) {
      return s;
    }
    if (attr.type != cudaMemoryTypeDevice) {
      return absl::InvalidArgumentError(
          absl::StrCat("kvwire gpu: 0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                       " is not CUDA device memory (cudaPointerGetAttributes type ",
                       static_cast<int>(attr.type), ")"));
    }
    const Driver& d = driver();
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
    return PointerInfo{attr.device, reinterpret_cast<void*>(base), size};
  }

  absl::StatusOr<void*> CreateStream(int device) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    cudaStream_t st = nullptr;
    if (absl::Status s = Error(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking),
                               "cudaStreamCreateWithFlags");
        !s.ok()) {
      return s;
    }
    return static_cast<void*>(st);
  }
  void DestroyStream(int device, void* stream) override {
    LogIfError(SetDevice(device));
    LogIfError(Error(cudaStreamDestroy(static_cast<cudaStream_t>(stream)), "cudaStreamDestroy"));
  }
  absl::Status SynchronizeStream(int device, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
  }

  absl::StatusOr<void*> CreateEvent(int device) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    cudaEvent_t ev = nullptr;
    if (absl::Status s = Error(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                               "cudaEventCreateWithFlags");
        !s.ok()) {
      return s;
    }
    return static_cast<void*>(ev);
  }
  void DestroyEvent(int device, void* event) override {
    LogIfError(SetDevice(device));
    LogIfError(Error(cudaEventDestroy(static_cast<cudaEvent_t>(event)), "cudaEventDestroy"));
  }
  absl::Status RecordEvent(int device, void* event, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(
        cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
        "cudaEventRecord");
  }
  absl::Status StreamWaitEvent(int device, void* stream, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
  }
  absl::StatusOr<bool> EventDone(int device, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error, but cudart records it
      return false;
    }
    if (absl::Status s = Error(e, "cudaEventQuery"); !s.ok()) return s;
    return true;
  }
  absl::Status SynchronizeEvent(int device, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
  }

  absl::Status CopyAsync(int device, void* dst, const void* src, size_t bytes,
                         void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
        absl::StrCat("cudaMemcpyAsync(", bytes, " B)"));
  }

  absl::StatusOr<IpcHandle> ExportIpc(int device, void* ptr) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    cudaIpcMemHandle_t h{};
    if (absl::Status s = Error(cudaIpcGetMemHandle(&h, ptr), "cudaIpcGetMemHandle"); !s.ok()) {
      return s;
    }
    IpcHandle out;
    out.backend = Backend::kCuda;
    std::memcpy(out.bytes.data(), &h, sizeof h);
    return out;
  }
  absl::StatusOr<void*> OpenIpc(int device, const IpcHandle& handle) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    cudaIpcMemHandle_t h{};
    std::memcpy(&h, handle.bytes.data(), sizeof h);
    void* p = nullptr;
    if (absl::Status s = Error(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
                               "cudaIpcOpenMemHandle");
        !s.ok()) {
      return s;
    }
    return p;
  }
  void CloseIpc(int device, void* ptr) override {
    LogIfError(SetDevice(device));
    LogIfError(Error(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle"));
  }

  absl::StatusOr<DmaBufRange> ExportDmaBuf(int device, const void* ptr, size_t bytes) override {
#if KVWIRE_GPU_CUDA_HAS_DMABUF
    const Driver& d = driver();
    if (d.get_handle == nullptr || d.get_address_range == nullptr) {
      return absl::UnimplementedError(
          "kvwire gpu: cuMemGetHandleForAddressRange is not available from this CUDA driver");
    }
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    // Export the whole allocation around [ptr, ptr+bytes), page-aligned as the driver wants;
    // the caller registers its sub-range at `offset` within the dma-buf.
    CUdeviceptr base = 0;
    size_t alloc_size = 0;
    const auto p = reinterpret_cast<CUdeviceptr>(ptr);
    if (CUresult r = d.get_address_range(&base, &alloc_size, p); r != CUDA_SUCCESS) {
      return DriverError(r, "cuMemGetAddressRange");
    }
    if (p + bytes > base + alloc_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("kvwire gpu: dma-buf range of ", bytes, " B at offset ", p - base,
                       " runs past its allocation of ", alloc_size, " B"));
    }
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const CUdeviceptr start = base & ~(page - 1);
    const uint64_t size = (base + alloc_size - start + page - 1) & ~(page - 1);
    int fd = -1;
    if (CUresult r = d.get_handle(&fd, start, size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
        r != CUDA_SUCCESS) {
      return DriverError(r, "cuMemGetHandleForAddressRange(DMA_BUF_FD)");
    }
    return DmaBufRange{fd, p - start, size};
#else
    (void)device;
    (void)ptr;
    (void)bytes;
    return absl::UnimplementedError(
        "kvwire gpu: this build's cuda.h has no cuMemGetHandleForAddressRange (CUDA < 11.7)");
#endif
  }
  void CloseDmaBuf(int fd) override { close(fd); }

  absl::Status EncodeKvRecords(int device, const KvEncodeArgs& args, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(static_cast<cudaError_t>(cuda_kernels::EncodeKvRecords(args, stream)),
                 "EncodeKvRecords kernel launch");
  }

 private:
  static absl::Status SetDevice(int device) {
    return Error(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
  static void LogIfError(const absl::Status& s) {
    if (!s.ok()) {
      KVW_LOG(kError, "gpu") << s.message();
    }
  }
  absl::Status DriverError(CUresult r, const char* what) {
    const char* text = nullptr;
    if (driver().get_error_string == nullptr ||
        driver().get_error_string(r, &text) != CUDA_SUCCESS) {
      text = "unknown driver error";
    }
    return absl::InternalError(
        absl::StrCat("kvwire gpu: ", what, ": CUresult ", static_cast<int>(r), ": ", text));
  }
  const Driver& driver() {
    std::call_once(driver_once_, [this] {
      Resolve("cuMemGetAddressRange", &driver_.get_address_range);
      Resolve("cuMemGetHandleForAddressRange", &driver_.get_handle);
      Resolve("cuDeviceGetAttribute", &driver_.device_get_attribute);
      Resolve("cuGetErrorString", &driver_.get_error_string);
      (void)cudaGetLastError();
    });
    return driver_;
  }

  std::once_flag driver_once_;
  Driver driver_;
};

}  // namespace

Runtime& CudaRuntime() {
  static CudaRuntimeImpl rt;
  return rt;
}

}  // namespace kvwire::gpu
