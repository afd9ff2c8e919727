// The one implementation of gpu::Runtime for real devices, shared by the CUDA and HIP
// backends: `Api` maps each call onto the vendor's runtime (cuda/runtime_cuda.cc,
// hip/runtime_hip.cc) and supplies the few parts that differ (why there is no device, pointer
// ranges, dma-buf export, kernel launches). Included only by those two files, each compiled
// against its vendor's headers.
//
// Api provides: types Error, StreamT, EventT, IpcT, Props; constants kBackend, kName ("CUDA"),
// kHostAllocCall / kFreeHostCall (the pinned-memory calls' names),
// kPrefix ("cuda", for call names in messages), kSuccess, kNotReady; and static functions
// CodeOf(Error), ErrorText(Error), the runtime calls used below, NoDeviceHint(),
// AddDeviceInfo(device, DeviceInfo*), AllocationRange(ptr) -> StatusOr<PointerInfo> (device
// unset), ExportDmaBuf(ptr, bytes), CloseDmaBuf(fd), EncodeKvRecords(args, stream).
#ifndef KVWIRE_GPU_DEVICE_RUNTIME_H_
#define KVWIRE_GPU_DEVICE_RUNTIME_H_

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

#include "src/gpu/runtime.h"
#include "src/util/log.h"

namespace kvwire::gpu {

template <typename Api>
class DeviceRuntime final : public Runtime {
 public:
  using Error = typename Api::Error;
  using StreamT = typename Api::StreamT;
  using EventT = typename Api::EventT;
  using IpcT = typename Api::IpcT;
  static_assert(sizeof(IpcT) == kIpcHandleBytes);

  // A Status for a runtime call's result: "kvwire gpu: <what>: <name>: <description>".
  static absl::Status Check(Error e, const std::string& what) {
    if (e == Api::kSuccess) return absl::OkStatus();
    return absl::Status(Api::CodeOf(e),
                        absl::StrCat("kvwire gpu: ", what, ": ", Api::ErrorText(e)));
  }
  static std::string Call(const char* name) { return absl::StrCat(Api::kPrefix, name); }

  Backend backend() const override { return Api::kBackend; }

  absl::StatusOr<int> DeviceCount() override {
    int n = 0;
    const Error e = Api::GetDeviceCount(&n);
    if (e == Api::kSuccess && n > 0) return n;
    std::string why = e == Api::kSuccess ? "0 devices" : Api::ErrorText(e);
    absl::StrAppend(&why, Api::NoDeviceHint());
    return absl::UnavailableError(absl::StrCat("kvwire gpu: no ", Api::kName, " device (",
                                               Call("GetDeviceCount"), ": ", why, ")"));
  }

  absl::StatusOr<DeviceInfo> GetDeviceInfo(int device) override {
    typename Api::Props prop{};
    if (absl::Status s = Check(Api::GetDeviceProperties(&prop, device),
                               absl::StrCat(Call("GetDeviceProperties"), "(", device, ")"));
        !s.ok()) {
      return s;
    }
    DeviceInfo info;
    info.ordinal = device;
    info.name = prop.name;
    info.total_bytes = prop.totalGlobalMem;
    char bus[64] = {};
    if (absl::Status s = Check(Api::DeviceGetPCIBusId(bus, sizeof bus, device),
                               absl::StrCat(Call("DeviceGetPCIBusId"), "(", device, ")"));
        !s.ok()) {
      return s;
    }
    info.pci_bus_id = NormalizePciBusId(bus);
    info.numa_node = NumaNodeOfPciDevice(info.pci_bus_id);
    Api::AddDeviceInfo(device, &info);
    return info;
  }

  absl::StatusOr<void*> Allocate(int device, size_t bytes) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    void* p = nullptr;
    if (absl::Status s = Check(Api::Malloc(&p, bytes), absl::StrCat(Call("Malloc"), "(", bytes,
                                                                    " B, device ", device, ")"));
        !s.ok()) {
      return s;
    }
    return p;
  }
  void Free(int device, void* ptr) override {
    LogIfError(SetDevice(device));
    LogIfError(Check(Api::Free(ptr), Call("Free")));
  }

  absl::StatusOr<void*> AllocatePinnedHost(int device, size_t bytes) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    void* p = nullptr;
    if (absl::Status s =
            Check(Api::HostAlloc(&p, bytes), absl::StrCat(Api::kHostAllocCall, "(", bytes, " B)"));
        !s.ok()) {
      return s;
    }
    return p;
  }
  void FreePinnedHost(void* ptr) override {
    LogIfError(Check(Api::FreeHost(ptr), Api::kFreeHostCall));
  }

  absl::StatusOr<PointerInfo> QueryPointer(const void* ptr) override {
    absl::StatusOr<int> device = Api::PointerDevice(ptr);
    if (!device.ok()) return device.status();
    // The range query is a driver call on the thread's current context.
    if (absl::Status s = SetDevice(*device); !s.ok()) return s;
    absl::StatusOr<PointerInfo> range = Api::AllocationRange(ptr);
    if (!range.ok()) return range.status();
    range->device = *device;
    return range;
  }

  absl::StatusOr<void*> CreateStream(int device) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    StreamT st = nullptr;
    if (absl::Status s = Check(Api::StreamCreateNonBlocking(&st), Call("StreamCreateWithFlags"));
        !s.ok()) {
      return s;
    }
    return static_cast<void*>(st);
  }
  void DestroyStream(int device, void* stream) override {
    LogIfError(SetDevice(device));
    LogIfError(Check(Api::StreamDestroy(AsStream(stream)), Call("StreamDestroy")));
  }
  absl::Status SynchronizeStream(int device, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Check(Api::StreamSynchronize(AsStream(stream)), Call("StreamSynchronize"));
  }

  absl::StatusOr<void*> CreateEvent(int device) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    EventT ev = nullptr;
    if (absl::Status s = Check(Api::EventCreateNoTiming(&ev), Call("EventCreateWithFlags"));
        !s.ok()) {
      return s;
    }
    return static_cast<void*>(ev);
  }
  void DestroyEvent(int device, void* event) override {
    LogIfError(SetDevice(device));
    LogIfError(Check(Api::EventDestroy(AsEvent(event)), Call("EventDestroy")));
  }
  absl::Status RecordEvent(int device, void* event, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Check(Api::EventRecord(AsEvent(event), AsStream(stream)), Call("EventRecord"));
  }
  absl::Status StreamWaitEvent(int device, void* stream, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Check(Api::StreamWaitEvent(AsStream(stream), AsEvent(event)), Call("StreamWaitEvent"));
  }
  absl::StatusOr<bool> EventDone(int device, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    const Error e = Api::EventQuery(AsEvent(event));
    if (e == Api::kNotReady) {
      (void)Api::GetLastError();  // not an error, but the runtime records it
      return false;
    }
    if (absl::Status s = Check(e, Call("EventQuery")); !s.ok()) return s;
    return true;
  }
  absl::Status SynchronizeEvent(int device, void* event) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Check(Api::EventSynchronize(AsEvent(event)), Call("EventSynchronize"));
  }

  absl::Status CopyAsync(int device, void* dst, const void* src, size_t bytes,
                         void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Check(Api::MemcpyAsync(dst, src, bytes, AsStream(stream)),
                 absl::StrCat(Call("MemcpyAsync"), "(", bytes, " B)"));
  }

  absl::StatusOr<IpcHandle> ExportIpc(int device, void* ptr) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    IpcT h{};
    if (absl::Status s = Check(Api::IpcGetMemHandle(&h, ptr), Call("IpcGetMemHandle")); !s.ok()) {
      return s;
    }
    IpcHandle out;
    out.backend = Api::kBackend;
    std::memcpy(out.bytes.data(), &h, sizeof h);
    return out;
  }
  absl::StatusOr<void*> OpenIpc(int device, const IpcHandle& handle) override {
    if (handle.backend != Api::kBackend) {
      return absl::InvalidArgumentError(absl::StrCat("kvwire gpu: an IPC handle of backend ",
                                                     BackendName(handle.backend), " given to the ",
                                                     Api::kName, " runtime"));
    }
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    IpcT h{};
    std::memcpy(&h, handle.bytes.data(), sizeof h);
    void* p = nullptr;
    if (absl::Status s = Check(Api::IpcOpenMemHandle(&p, h), Call("IpcOpenMemHandle")); !s.ok()) {
      return s;
    }
    return p;
  }
  void CloseIpc(int device, void* ptr) override {
    LogIfError(SetDevice(device));
    LogIfError(Check(Api::IpcCloseMemHandle(ptr), Call("IpcCloseMemHandle")));
  }

  absl::StatusOr<DmaBufRange> ExportDmaBuf(int device, const void* ptr, size_t bytes) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Api::ExportDmaBuf(ptr, bytes);
  }
  void CloseDmaBuf(int fd) override { Api::CloseDmaBuf(fd); }

  absl::Status EncodeKvRecords(int device, const KvEncodeArgs& args, void* stream) override {
    if (absl::Status s = SetDevice(device); !s.ok()) return s;
    return Check(Api::EncodeKvRecords(args, stream), "EncodeKvRecords kernel launch");
  }

 private:
  static StreamT AsStream(void* s) { return static_cast<StreamT>(s); }
  static EventT AsEvent(void* e) { return static_cast<EventT>(e); }
  static absl::Status SetDevice(int device) {
    return Check(Api::SetDevice(device), absl::StrCat(Call("SetDevice"), "(", device, ")"));
  }
  static void LogIfError(const absl::Status& s) {
    if (!s.ok()) {
      KVW_LOG(kError, "gpu") << s.message();
    }
  }
};

}  // namespace kvwire::gpu

#endif  // KVWIRE_GPU_DEVICE_RUNTIME_H_
