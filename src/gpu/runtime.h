// GPU runtime shim: one small interface over CUDA, HIP, or no GPU runtime at all, with the
// backend chosen at configure time (KVWIRE_GPU=none|cuda|hip|auto, see cmake/gpu.cmake).
//
// Runtime is the per-backend table of raw calls; the RAII types below (DeviceBuffer, Stream,
// Event, IpcMapping, DmaBuf) are what callers use. Every error is an absl::Status carrying the
// runtime's own error name and string. A program whose runtime has no device gets one line
// that says why from DeviceCount() ("kvwire gpu: no CUDA device (cudaGetDeviceCount: ...)").
//
//   gpu::Runtime& rt = gpu::DefaultRuntime();
//   ASSIGN_OR_RETURN(gpu::DeviceBuffer buf, gpu::DeviceBuffer::Allocate(rt, 0, bytes));
//   ASSIGN_OR_RETURN(gpu::Stream stream, gpu::Stream::Create(rt, 0));
//   RETURN_IF_ERROR(stream.Copy(buf.data(), host, bytes));
#ifndef KVWIRE_GPU_RUNTIME_H_
#define KVWIRE_GPU_RUNTIME_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "src/gpu/kv_record.h"

namespace kvwire::gpu {

// kEmulated: host memory standing in for a device (tests of the engine's GPU paths on machines
// without one; see tests/support/emulated_gpu.h). Never the default of a build.
enum class Backend : uint8_t { kNone = 0, kCuda = 1, kHip = 2, kEmulated = 3 };
const char* BackendName(Backend backend);  // "none", "cuda", "hip", "emulated"

struct DeviceInfo {
  int ordinal = -1;
  std::string name;
  std::string pci_bus_id;  // sysfs form, lower case: "0000:3b:00.0"
  int numa_node = -1;      // -1: unknown, or a machine without NUMA
  uint64_t total_bytes = 0;
  // The runtime can export this device's memory as a dma-buf (for ibv_reg_dmabuf_mr).
  bool dma_buf = false;
};

// A runtime IPC handle (cudaIpcMemHandle_t / hipIpcMemHandle_t: 64 opaque bytes), tagged with
// the backend that made it so that a handle never reaches the wrong runtime.
inline constexpr size_t kIpcHandleBytes = 64;
struct IpcHandle {
  Backend backend = Backend::kNone;
  std::array<uint8_t, kIpcHandleBytes> bytes{};
};

// A dma-buf covering a device range: `fd` maps [ptr - offset, ptr - offset + size), so a
// registration of the caller's range uses (fd, offset, length). The exported range is the
// page-aligned allocation around the caller's range, which is what the runtimes accept.
struct DmaBufRange {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t size = 0;
};

// The device allocation a pointer lies in (what IPC export and dma-buf export work on).
struct PointerInfo {
  int device = -1;
  void* allocation_base = nullptr;
  size_t allocation_size = 0;
};

// The raw calls of one runtime. Process-wide instances; thread-safe as the runtimes are. Every
// call names its device (the runtimes keep a per-thread current device; the backends set it).
// Handles are the runtime's own (cudaStream_t, hipEvent_t, ...) as void*.
class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual Backend backend() const = 0;

  // Devices visible to this process; Unavailable with one line saying why when there are none.
  virtual absl::StatusOr<int> DeviceCount() = 0;
  virtual absl::StatusOr<DeviceInfo> GetDeviceInfo(int device) = 0;

  virtual absl::StatusOr<void*> Allocate(int device, size_t bytes) = 0;
  // Release calls run in destructors: failures are logged, not returned.
  virtual void Free(int device, void* ptr) = 0;
  // Page-locked host memory (fast, asynchronous copies to and from the devices), allocated
  // with `device` current (the runtimes tie it to that device's context).
  virtual absl::StatusOr<void*> AllocatePinnedHost(int device, size_t bytes) = 0;
  virtual void FreePinnedHost(void* ptr) = 0;
  // Device and allocation of `ptr`; InvalidArgument when it is not device memory of this
  // runtime (host memory, pinned host memory, or an unknown address).
  virtual absl::StatusOr<PointerInfo> QueryPointer(const void* ptr) = 0;
  virtual absl::StatusOr<void*> CreateStream(int device) = 0;  // non-blocking stream
  virtual void DestroyStream(int device, void* stream) = 0;
  virtual absl::Status SynchronizeStream(int device, void* stream) = 0;
  virtual absl::StatusOr<void*> CreateEvent(int device) = 0;  // timing disabled
  virtual void DestroyEvent(int device, void* event) = 0;
  virtual absl::Status RecordEvent(int device, void* event, void* stream) = 0;
  virtual absl::Status StreamWaitEvent(int device, void* stream, void* event) = 0;
  virtual absl::StatusOr<bool> EventDone(int device, void* event) = 0;
  virtual absl::Status SynchronizeEvent(int device, void* event) = 0;
  // Any direction: the runtimes' unified addressing tells host from device pointers.
  virtual absl::Status CopyAsync(int device, void* dst, const void* src, size_t bytes,
                                 void* stream) = 0;
  virtual absl::StatusOr<IpcHandle> ExportIpc(int device, void* ptr) = 0;
  virtual absl::StatusOr<void*> OpenIpc(int device, const IpcHandle& handle) = 0;
  virtual void CloseIpc(int device, void* ptr) = 0;
  // Unimplemented when this runtime (or its headers at configure time) has no dma-buf export.
  virtual absl::StatusOr<DmaBufRange> ExportDmaBuf(int device, const void* ptr, size_t bytes) = 0;
  virtual void CloseDmaBuf(int fd) = 0;
  // The paged fp8 KV-record encode (kv_record.h) on `stream`; args point to device memory.
  virtual absl::Status EncodeKvRecords(int device, const KvEncodeArgs& args, void* stream) = 0;
};

// The runtime compiled into this build (KVWIRE_GPU), or NoneRuntime(), unless replaced by
// SetDefaultRuntime.
Runtime& DefaultRuntime();
// Replaces what DefaultRuntime() returns in this process (nullptr: the build's again). For
// programs that bring their own runtime (the emulated one in tests); call it before any engine
// or connector exists, as they keep the runtime they were created with.
void SetDefaultRuntime(Runtime* runtime);
// Always present: every call fails with "kvwire gpu: no GPU runtime in this build (...)".
Runtime& NoneRuntime();
// Defined only when that backend is compiled and linked (see cmake/gpu.cmake).
Runtime& CudaRuntime();
Runtime& HipRuntime();

// --- RAII ------------------------------------------------------------------------------------

class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Allocate(Runtime& rt, int device, size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  int device() const { return device_; }

 private:
  DeviceBuffer(Runtime* rt, int device, void* ptr, size_t size)
      : rt_(rt), device_(device), ptr_(ptr), size_(size) {}
  void Reset();
  Runtime* rt_ = nullptr;
  int device_ = -1;
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

class Event;

class Stream {
 public:
  static absl::StatusOr<Stream> Create(Runtime& rt, int device);
  Stream() = default;
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { Reset(); }

  absl::Status CopyAsync(void* dst, const void* src, size_t bytes);
  // CopyAsync, then Synchronize.
  absl::Status Copy(void* dst, const void* src, size_t bytes);
  // Later work on this stream waits for `event` (on the device; the host does not block).
  absl::Status Wait(const Event& event);
  absl::Status Synchronize();
  absl::Status EncodeKvRecords(const KvEncodeArgs& args);

  void* native() const { return stream_; }
  int device() const { return device_; }
  Runtime* runtime() const { return rt_; }

 private:
  Stream(Runtime* rt, int device, void* stream) : rt_(rt), device_(device), stream_(stream) {}
  void Reset();
  Runtime* rt_ = nullptr;
  int device_ = -1;
  void* stream_ = nullptr;
};

class Event {
 public:
  static absl::StatusOr<Event> Create(Runtime& rt, int device);
  Event() = default;
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { Reset(); }

  absl::Status Record(Stream& stream);
  absl::StatusOr<bool> Done() const;
  absl::Status Synchronize() const;

  void* native() const { return event_; }
  int device() const { return device_; }

 private:
  Event(Runtime* rt, int device, void* event) : rt_(rt), device_(device), event_(event) {}
  void Reset();
  Runtime* rt_ = nullptr;
  int device_ = -1;
  void* event_ = nullptr;
};

// Another process's device memory, mapped from its IpcHandle; unmapped on destruction.
class IpcMapping {
 public:
  static absl::StatusOr<IpcMapping> Open(Runtime& rt, int device, const IpcHandle& handle);
  IpcMapping() = default;
  IpcMapping(IpcMapping&& other) noexcept;
  IpcMapping& operator=(IpcMapping&& other) noexcept;
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  ~IpcMapping() { Reset(); }

  void* data() const { return ptr_; }

 private:
  IpcMapping(Runtime* rt, int device, void* ptr) : rt_(rt), device_(device), ptr_(ptr) {}
  void Reset();
  Runtime* rt_ = nullptr;
  int device_ = -1;
  void* ptr_ = nullptr;
};

// Page-locked host memory; freed on destruction.
class PinnedHostBuffer {
 public:
  static absl::StatusOr<PinnedHostBuffer> Allocate(Runtime& rt, int device, size_t bytes);
  PinnedHostBuffer() = default;
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;
  ~PinnedHostBuffer() { Reset(); }

  std::byte* data() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  PinnedHostBuffer(Runtime* rt, std::byte* ptr, size_t size) : rt_(rt), ptr_(ptr), size_(size) {}
  void Reset();
  Runtime* rt_ = nullptr;
  std::byte* ptr_ = nullptr;
  size_t size_ = 0;
};

// An exported dma-buf; its fd is closed on destruction.
class DmaBuf {
 public:
  static absl::StatusOr<DmaBuf> Export(Runtime& rt, int device, const void* ptr, size_t bytes);
  DmaBuf() = default;
  DmaBuf(DmaBuf&& other) noexcept;
  DmaBuf& operator=(DmaBuf&& other) noexcept;
  DmaBuf(const DmaBuf&) = delete;
  DmaBuf& operator=(const DmaBuf&) = delete;
  ~DmaBuf() { Reset(); }

  const DmaBufRange& range() const { return range_; }
  int fd() const { return range_.fd; }

 private:
  DmaBuf(Runtime* rt, DmaBufRange range) : rt_(rt), range_(range) {}
  void Reset();
  Runtime* rt_ = nullptr;
  DmaBufRange range_;
};

// --- bounded waits ------------------------------------------------------------------------------

// Waits for `event` by polling EventDone (spinning briefly, then napping up to 200 us), never
// with a runtime synchronize that has no deadline: DeadlineExceeded naming `what` once
// `deadline` passes, so that a device that stops making progress costs the caller an error, not
// a hung thread. Header-only, so that transports use it without linking a backend.
inline absl::Status WaitForEvent(Runtime& rt, int device, void* event, absl::Time deadline,
                                 const char* what) {
  absl::Duration nap = absl::Microseconds(10);
  for (int polls = 0;; ++polls) {
    absl::StatusOr<bool> done = rt.EventDone(device, event);
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("kvwire gpu: ", what, " did not complete on device ", device, " in time"));
    }
    if (polls < 256) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(nap);
      nap = std::min(nap * 2, absl::Microseconds(200));
    }
  }
}

// Everything queued on `stream` so far, waited for through `event` (recorded here) as above.
inline absl::Status WaitForStream(Runtime& rt, int device, void* stream, void* event,
                                  absl::Time deadline, const char* what) {
  if (absl::Status s = rt.RecordEvent(device, event, stream); !s.ok()) return s;
  return WaitForEvent(rt, device, event, deadline, what);
}

// --- helpers shared by the backends ---------------------------------------------------------

// "0000:3B:00.0" or "3b:00.0" -> "0000:3b:00.0" (the sysfs name); empty when malformed.
std::string NormalizePciBusId(const std::string& bus_id);
// /sys/bus/pci/devices/<id>/numa_node; -1 when absent or unknown.
int NumaNodeOfPciDevice(const std::string& bus_id, const std::string& sysfs_root = "/sys");

}  // namespace kvwire::gpu

#endif  // KVWIRE_GPU_RUNTIME_H_
