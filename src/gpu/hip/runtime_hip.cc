// HIP backend (ROCm): the HIP runtime API (libamdhip64). dma-buf export uses
// hsa_amd_portable_export_dmabuf or hipMemGetHandleForAddressRange when configure found them
// in the headers (ROCm >= 5.7 / 6.x); Debian 12's ROCm 5.2 has neither, and then GPU memory
// over rdma needs the peer-memory path (ibv_reg_mr on the device pointer).
#include <cstring>
#include <unistd.h>

#include <hip/hip_runtime_api.h>

#include "absl/strings/str_cat.h"

#include "src/gpu/gpu_config.h"
#include "src/gpu/kernels/kernels.h"
#include "src/gpu/runtime.h"
#include "src/util/log.h"

#if KVWIRE_GPU_HIP_HAS_HSA_DMABUF
#include <hsa/hsa_ext_amd.h>
#endif

namespace kvwire::gpu {
namespace {

static_assert(sizeof(hipIpcMemHandle_t) == kIpcHandleBytes);

std::string ErrorText(hipError_t e) {
  const std::string name = hipGetErrorName(e), text = hipGetErrorString(e);
  // Some HIP releases return the name as the description too.
  return text == name ? name : absl::StrCat(name, ": ", text);
}
absl::Status Error(hipError_t e, const std::string& what) {
  if (e == hipSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat("kvwire gpu: ", what, ": ", ErrorText(e));
  switch (e) {
    case hipErrorOutOfMemory:
      return absl::ResourceExhaustedError(msg);
    case hipErrorInvalidValue:
    case hipErrorInvalidDevice:
    case hipErrorInvalidDevicePointer:
    case hipErrorInvalidHandle:
      return absl::InvalidArgumentError(msg);
    case hipErrorNoDevice:
    case hipErrorInsufficientDriver:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

class HipRuntimeImpl final : public Runtime {
 public:
  Backend backend() const override { return Backend::kHip; }

  absl::StatusOr<int> DeviceCount() override {
    int n = 0;
    const hipError_t e = hipGetDeviceCount(&n);
    if (e == hipSuccess && n > 0) return n;
    std::string why = e == hipSuccess ? "0 devices" : ErrorText(e);
    if (access("/dev/kfd", F_OK) != 0) absl::StrAppend(&why, "; no /dev/kfd (amdgpu driver)");
    return absl::UnavailableError(
        absl::StrCat("kvwire gpu: no HIP device (hipGetDeviceCount: ", why, ")"));
  }

  absl::StatusOr<DeviceInfo> GetDeviceInfo(int device) override {
    hipDeviceProp_t prop{};
    if (absl::Status s = Error(hipGetDeviceProperties(&prop, device),
                               absl::StrCat("hipGetDeviceProperties(", device, ")"));
        !s.ok()) {
      return s;
    }
    DeviceInfo info;
    info.ordinal = device;
    info.name = prop.name;
    info.total_bytes = prop.totalGlobalMem;
    char bus[64] = {};
    if (absl::Status s = Error(hipDeviceGetPCIBusId(bus, sizeof bus, device),
                               absl::StrCat("hipDeviceGetPCIBusId(", device, ")"));
        !s.ok()) {
      return s;
    }
    info.pci_bus_id = NormalizePciBusId(bus);
    info.numa_node = NumaNodeOfPciDevice(info.pci_bus_id);
    info.dma_buf = KVWIRE_GPU_HIP_HAS_HSA_DMABUF || KVWIRE_GPU_HIP_HAS_HIP_DMABUF;
    return info;
  }

  absl::StatusOr<void*> Allocate(int device, size_t bytes) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    void* p = nullptr;
    if (absl::Status s = Error(hipMalloc(&p, bytes),
                               absl::StrCat("hipMalloc(", bytes, " B, device ", device, ")"));
        !s.ok()) {
      return s;
    }
    return p;
  }
  void Free(int device, void* ptr) override {
    LogIfError(SetDevice(device));
    LogIfError(Error(hipFree(ptr), "hipFree"));
  }

  absl::StatusOr<void*> AllocatePinnedHost(size_t bytes) override {
    void* p = nullptr;
    if (absl::Status s = Error(hipHostMalloc(&p, bytes, hipHostMallocPortable),
                               absl::StrCat("hipHostMalloc(", bytes, " B)"));
        !s.ok()) {
      return s;
    }
    return p;
  }
  void FreePinnedHost(void* ptr) override { LogIfError(Error(hipHostFree(ptr), "hipHostFree")); }

  absl::StatusOr<PointerInfo> QueryPointer(const void* ptr) override {
    hipPointerAttribute_t attr{};
    if (absl::Status s = Error(hipPointerGetAttributes(&attr, ptr), "hipPointerGetAttributes");
        !s.ok()) {
      return s;
    }
    // ROCm 5.x names the field memoryType, 6.x type; both are the first member.
    hipMemoryType type{};
    std::memcpy(&type, &attr, sizeof type);
    if (type != hipMemoryTypeDevice) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kvwire gpu: 0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
          " is not HIP device memory (hipPointerGetAttributes type ", static_cast<int>(type), ")"));
    }
    hipDeviceptr_t base = nullptr;
    size_t size = 0;
    if (absl::Status s = Error(hipMemGetAddressRange(&base, &size, const_cast<void*>(ptr)),
                               "hipMemGetAddressRange");
        !s.ok()) {
      return s;
    }
    return PointerInfo{attr.device, base, size};
  }

  absl::StatusOr<void*> CreateStream(int device) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    hipStream_t st = nullptr;
    if (absl::Status s =
            Error(hipStreamCreateWithFlags(&st, hipStreamNonBlocking), "hipStreamCreateWithFlags");
        !s.ok()) {
      return s;
    }
    return static_cast<void*>(st);
  }
  void DestroyStream(int device, void* stream) override {
    LogIfError(SetDevice(device));
    LogIfError(Error(hipStreamDestroy(static_cast<hipStream_t>(stream)), "hipStreamDestroy"));
  }
  absl::Status SynchronizeStream(int device, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(hipStreamSynchronize(static_cast<hipStream_t>(stream)), "hipStreamSynchronize");
  }

  absl::StatusOr<void*> CreateEvent(int device) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    hipEvent_t ev = nullptr;
    if (absl::Status s =
            Error(hipEventCreateWithFlags(&ev, hipEventDisableTiming), "hipEventCreateWithFlags");
        !s.ok()) {
      return s;
    }
    return static_cast<void*>(ev);
  }
  void DestroyEvent(int device, void* event) override {
    LogIfError(SetDevice(device));
    LogIfError(Error(hipEventDestroy(static_cast<hipEvent_t>(event)), "hipEventDestroy"));
  }
  absl::Status RecordEvent(int device, void* event, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(hipEventRecord(static_cast<hipEvent_t>(event), static_cast<hipStream_t>(stream)),
                 "hipEventRecord");
  }
  absl::Status StreamWaitEvent(int device, void* stream, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(
        hipStreamWaitEvent(static_cast<hipStream_t>(stream), static_cast<hipEvent_t>(event), 0),
        "hipStreamWaitEvent");
  }
  absl::StatusOr<bool> EventDone(int device, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    const hipError_t e = hipEventQuery(static_cast<hipEvent_t>(event));
    if (e == hipErrorNotReady) {
      (void)hipGetLastError();
      return false;
    }
    if (absl::Status s = Error(e, "hipEventQuery"); !s.ok()) return s;
    return true;
  }
  absl::Status SynchronizeEvent(int device, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(hipEventSynchronize(static_cast<hipEvent_t>(event)), "hipEventSynchronize");
  }

  absl::Status CopyAsync(int device, void* dst, const void* src, size_t bytes,
                         void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(
        hipMemcpyAsync(dst, src, bytes, hipMemcpyDefault, static_cast<hipStream_t>(stream)),
        absl::StrCat("hipMemcpyAsync(", bytes, " B)"));
  }

  absl::StatusOr<IpcHandle> ExportIpc(int device, void* ptr) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    hipIpcMemHandle_t h{};
    if (absl::Status s = Error(hipIpcGetMemHandle(&h, ptr), "hipIpcGetMemHandle"); !s.ok()) {
      return s;
    }
    IpcHandle out;
    out.backend = Backend::kHip;
    std::memcpy(out.bytes.data(), &h, sizeof h);
    return out;
  }
  absl::StatusOr<void*> OpenIpc(int device, const IpcHandle& handle) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    hipIpcMemHandle_t h{};
    std::memcpy(&h, handle.bytes.data(), sizeof h);
    void* p = nullptr;
    if (absl::Status s =
            Error(hipIpcOpenMemHandle(&p, h, hipIpcMemLazyEnablePeerAccess), "hipIpcOpenMemHandle");
        !s.ok()) {
      return s;
    }
    return p;
  }
  void CloseIpc(int device, void* ptr) override {
    LogIfError(SetDevice(device));
    LogIfError(Error(hipIpcCloseMemHandle(ptr), "hipIpcCloseMemHandle"));
  }

  absl::StatusOr<DmaBufRange> ExportDmaBuf(int device, const void* ptr, size_t bytes) override {
#if KVWIRE_GPU_HIP_HAS_HSA_DMABUF
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    int fd = -1;
    uint64_t offset = 0;
    if (hsa_status_t r = hsa_amd_portable_export_dmabuf(ptr, bytes, &fd, &offset);
        r != HSA_STATUS_SUCCESS) {
      return absl::InternalError(
          absl::StrCat("kvwire gpu: hsa_amd_portable_export_dmabuf: hsa_status ", r));
    }
    return DmaBufRange{fd, offset, offset + bytes};
#elif KVWIRE_GPU_HIP_HAS_HIP_DMABUF
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    // Whole pages around the range; the caller's range sits at `offset` within them.
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t start = p & ~(page - 1);
    const uint64_t size = (p + bytes - start + page - 1) & ~(page - 1);
    int fd = -1;
    if (absl::Status s =
            Error(hipMemGetHandleForAddressRange(&fd, reinterpret_cast<hipDeviceptr_t>(start), size,
                                                 hipMemRangeHandleTypeDmaBufFd, 0),
                  "hipMemGetHandleForAddressRange");
        !s.ok()) {
      return s;
    }
    return DmaBufRange{fd, p - start, size};
#else
    (void)device;
    (void)ptr;
    (void)bytes;
    return absl::UnimplementedError(
        "kvwire gpu: no dma-buf export in this HIP (hsa_amd_portable_export_dmabuf and "
        "hipMemGetHandleForAddressRange were not in its headers at configure time)");
#endif
  }
  void CloseDmaBuf(int fd) override {
#if KVWIRE_GPU_HIP_HAS_HSA_DMABUF
    hsa_amd_portable_close_dmabuf(fd);
#else
    close(fd);
#endif
  }

  absl::Status EncodeKvRecords(int device, const KvEncodeArgs& args, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Error(static_cast<hipError_t>(hip_kernels::EncodeKvRecords(args, stream)),
                 "EncodeKvRecords kernel launch");
  }

 private:
  static absl::Status SetDevice(int device) {
    return Error(hipSetDevice(device), absl::StrCat("hipSetDevice(", device, ")"));
  }
  static void LogIfError(const absl::Status& s) {
    if (!s.ok()) {
      KVW_LOG(kError, "gpu") << s.message();
    }
  }
};

}  // namespace

Runtime& HipRuntime() {
  static HipRuntimeImpl rt;
  return rt;
}

}  // namespace kvwire::gpu
