#include "src/gpu/runtime.h"

#include <cctype>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#include "src/gpu/kv_record_cpu.h"

namespace kvwire::gpu {

const char* BackendName(Backend backend) {
  switch (backend) {
    case Backend::kNone:
      return "none";
    case Backend::kCuda:
      return "cuda";
    case Backend::kHip:
      return "hip";
    case Backend::kEmulated:
      return "emulated";
  }
  return "unknown";
}

// --- DeviceBuffer ----------------------------------------------------------------------------

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(Runtime& rt, int device, size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("kvwire gpu: allocation of 0 bytes");
  absl::StatusOr<void*> ptr = rt.Allocate(device, bytes);
  if (!ptr.ok()) return ptr.status();
  return DeviceBuffer(&rt, device, *ptr, bytes);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : rt_(std::exchange(other.rt_, nullptr)),
      device_(std::exchange(other.device_, -1)),
      ptr_(std::exchange(other.ptr_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    rt_ = std::exchange(other.rt_, nullptr);
    device_ = std::exchange(other.device_, -1);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}
void DeviceBuffer::Reset() {
  if (ptr_ != nullptr) rt_->Free(device_, ptr_);
  ptr_ = nullptr;
  size_ = 0;
}

// --- Stream ----------------------------------------------------------------------------------

absl::StatusOr<Stream> Stream::Create(Runtime& rt, int device) {
  absl::StatusOr<void*> s = rt.CreateStream(device);
  if (!s.ok()) return s.status();
  return Stream(&rt, device, *s);
}
Stream::Stream(Stream&& other) noexcept
    : rt_(std::exchange(other.rt_, nullptr)),
      device_(std::exchange(other.device_, -1)),
      stream_(std::exchange(other.stream_, nullptr)) {}
Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Reset();
    rt_ = std::exchange(other.rt_, nullptr);
    device_ = std::exchange(other.device_, -1);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}
void Stream::Reset() {
  if (stream_ != nullptr) rt_->DestroyStream(device_, stream_);
  stream_ = nullptr;
}
absl::Status Stream::CopyAsync(void* dst, const void* src, size_t bytes) {
  if (rt_ == nullptr) return absl::FailedPreconditionError("kvwire gpu: empty Stream");
  if (bytes == 0) return absl::OkStatus();
  return rt_->CopyAsync(device_, dst, src, bytes, stream_);
}
absl::Status Stream::Copy(void* dst, const void* src, size_t bytes) {
  if (absl::Status s = CopyAsync(dst, src, bytes); !s.ok()) return s;
  return Synchronize();
}
absl::Status Stream::Wait(const Event& event) {
  if (rt_ == nullptr || event.native() == nullptr) {
    return absl::FailedPreconditionError("kvwire gpu: empty Stream or Event");
  }
  return rt_->StreamWaitEvent(device_, stream_, event.native());
}
absl::Status Stream::Synchronize() {
  if (rt_ == nullptr) return absl::FailedPreconditionError("kvwire gpu: empty Stream");
  return rt_->SynchronizeStream(device_, stream_);
}
absl::Status Stream::EncodeKvRecords(const KvEncodeArgs& args) {
  if (rt_ == nullptr) return absl::FailedPreconditionError("kvwire gpu: empty Stream");
  if (absl::Status s = ValidateKvEncodeArgs(args); !s.ok()) return s;
  if (args.num_tokens == 0) return absl::OkStatus();
  return rt_->EncodeKvRecords(device_, args, stream_);
}

// --- Event -----------------------------------------------------------------------------------

absl::StatusOr<Event> Event::Create(Runtime& rt, int device) {
  absl::StatusOr<void*> e = rt.CreateEvent(device);
  if (!e.ok()) return e.status();
  return Event(&rt, device, *e);
}
Event::Event(Event&& other) noexcept
    : rt_(std::exchange(other.rt_, nullptr)),
      device_(std::exchange(other.device_, -1)),
      event_(std::exchange(other.event_, nullptr)) {}
Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Reset();
    rt_ = std::exchange(other.rt_, nullptr);
    device_ = std::exchange(other.device_, -1);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}
void Event::Reset() {
  if (event_ != nullptr) rt_->DestroyEvent(device_, event_);
  event_ = nullptr;
}
absl::Status Event::Record(Stream& stream) {
  if (rt_ == nullptr || stream.native() == nullptr) {
    return absl::FailedPreconditionError("kvwire gpu: empty Stream or Event");
  }
  return rt_->RecordEvent(device_, event_, stream.native());
}
absl::StatusOr<bool> Event::Done() const {
  if (rt_ == nullptr) return absl::FailedPreconditionError("kvwire gpu: empty Event");
  return rt_->EventDone(device_, event_);
}
absl::Status Event::Synchronize() const {
  if (rt_ == nullptr) return absl::FailedPreconditionError("kvwire gpu: empty Event");
  return rt_->SynchronizeEvent(device_, event_);
}

// --- IpcMapping ------------------------------------------------------------------------------

absl::StatusOr<IpcMapping> IpcMapping::Open(Runtime& rt, int device, const IpcHandle& handle) {
  if (handle.backend != rt.backend()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kvwire gpu: IPC handle from the ", BackendName(handle.backend),
                     " runtime given to the ", BackendName(rt.backend()), " runtime"));
  }
  absl::StatusOr<void*> ptr = rt.OpenIpc(device, handle);
  if (!ptr.ok()) return ptr.status();
  return IpcMapping(&rt, device, *ptr);
}
IpcMapping::IpcMapping(IpcMapping&& other) noexcept
    : rt_(std::exchange(other.rt_, nullptr)),
      device_(std::exchange(other.device_, -1)),
      ptr_(std::exchange(other.ptr_, nullptr)) {}
IpcMapping& IpcMapping::operator=(IpcMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    rt_ = std::exchange(other.rt_, nullptr);
    device_ = std::exchange(other.device_, -1);
    ptr_ = std::exchange(other.ptr_, nullptr);
  }
  return *this;
}
void IpcMapping::Reset() {
  if (ptr_ != nullptr) rt_->CloseIpc(device_, ptr_);
  ptr_ = nullptr;
}

// --- PinnedHostBuffer ------------------------------------------------------------------------

absl::StatusOr<PinnedHostBuffer> PinnedHostBuffer::Allocate(Runtime& rt, int device, size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("kvwire gpu: pinned allocation of 0 bytes");
  absl::StatusOr<void*> ptr = rt.AllocatePinnedHost(device, bytes);
  if (!ptr.ok()) return ptr.status();
  return PinnedHostBuffer(&rt, static_cast<std::byte*>(*ptr), bytes);
}
PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
    : rt_(std::exchange(other.rt_, nullptr)),
      ptr_(std::exchange(other.ptr_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}
PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    rt_ = std::exchange(other.rt_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}
void PinnedHostBuffer::Reset() {
  if (ptr_ != nullptr) rt_->FreePinnedHost(ptr_);
  ptr_ = nullptr;
  size_ = 0;
}

// --- DmaBuf ----------------------------------------------------------------------------------

absl::StatusOr<DmaBuf> DmaBuf::Export(Runtime& rt, int device, const void* ptr, size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("kvwire gpu: dma-buf of 0 bytes");
  absl::StatusOr<DmaBufRange> r = rt.ExportDmaBuf(device, ptr, bytes);
  if (!r.ok()) return r.status();
  return DmaBuf(&rt, *r);
}
DmaBuf::DmaBuf(DmaBuf&& other) noexcept
    : rt_(std::exchange(other.rt_, nullptr)), range_(std::exchange(other.range_, {})) {}
DmaBuf& DmaBuf::operator=(DmaBuf&& other) noexcept {
  if (this != &other) {
    Reset();
    rt_ = std::exchange(other.rt_, nullptr);
    range_ = std::exchange(other.range_, {});
  }
  return *this;
}
void DmaBuf::Reset() {
  if (range_.fd >= 0) rt_->CloseDmaBuf(range_.fd);
  range_ = {};
}

// --- helpers ---------------------------------------------------------------------------------

std::string NormalizePciBusId(const std::string& bus_id) {
  std::string id = absl::AsciiStrToLower(absl::StripAsciiWhitespace(bus_id));
  // The runtimes print "0000:3B:00.0"; some tools drop the domain.
  if (id.size() == 7) id = "0000:" + id;
  // Some runtimes print an 8-digit domain ("00000000:3b:00.0"); sysfs uses 4.
  if (id.size() == 16 && id.compare(0, 4, "0000") == 0) id = id.substr(4);
  if (id.size() != 12 || id[4] != ':' || id[7] != ':' || id[10] != '.') return "";
  for (size_t i = 0; i < id.size(); ++i) {
    if (i == 4 || i == 7 || i == 10) continue;
    if (!std::isxdigit(static_cast<unsigned char>(id[i]))) return "";
  }
  return id;
}

int NumaNodeOfPciDevice(const std::string& bus_id, const std::string& sysfs_root) {
  const std::string id = NormalizePciBusId(bus_id);
  if (id.empty()) return -1;
  std::ifstream in(sysfs_root + "/bus/pci/devices/" + id + "/numa_node");
  int node = -1;
  if (!(in >> node)) return -1;
  return node < 0 ? -1 : node;
}

}  // namespace kvwire::gpu
