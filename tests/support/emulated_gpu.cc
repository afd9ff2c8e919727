#include "tests/support/emulated_gpu.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <functional>
#include <map>
#include <thread>
#include <unistd.h>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/gpu/kv_record_cpu.h"
#include "src/util/mutex.h"

namespace kvwire::testing {
namespace {

using gpu::Backend;

constexpr char kMagic[8] = {'K', 'V', 'W', 'E', 'M', 'U', '1', '\0'};

// The IPC handle's 64 bytes.
struct HandleRecord {
  char magic[8];
  int32_t pid;
  int32_t fd;
  uint64_t size;
  int32_t device;
};
static_assert(sizeof(HandleRecord) <= gpu::kIpcHandleBytes);

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

uint64_t PageRound(uint64_t n) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

// One device allocation, or another process's allocation opened from its IPC handle.
struct Allocation {
  int device = -1;
  std::byte* device_view = nullptr;  // the address callers see (PROT_NONE when guarded)
  std::byte* alias = nullptr;        // the runtime's own read/write mapping
  uint64_t size = 0;
  int memfd = -1;
  bool imported = false;
};

// A stream: FIFO work run by its own thread. `submitted`/`completed` count work items, so an
// event is "the stream's submitted count when it was recorded".
class EmuStream {
 public:
  EmuStream(int device, absl::Duration copy_delay)
      : device_(device), copy_delay_(copy_delay), thread_([this] { Run(); }) {}
  ~EmuStream() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
      cv_.SignalAll();
    }
    thread_.join();
  }

  int device() const { return device_; }
  absl::Duration copy_delay() const { return copy_delay_; }

  uint64_t Enqueue(std::function<void()> work) {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(work));
    ++submitted_;
    cv_.SignalAll();
    return submitted_;
  }
  uint64_t submitted() {
    MutexLock lock(&mu_);
    return submitted_;
  }
  bool Reached(uint64_t seq) {
    MutexLock lock(&mu_);
    return completed_ >= seq;
  }
  void WaitFor(uint64_t seq) {
    MutexLock lock(&mu_);
    while (completed_ < seq) cv_.Wait(&mu_);
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> work;
      {
        MutexLock lock(&mu_);
        while (queue_.empty() && !stop_) cv_.Wait(&mu_);
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
      MutexLock lock(&mu_);
      ++completed_;
      cv_.SignalAll();
    }
  }

  const int device_;
  const absl::Duration copy_delay_;
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

struct EmuEvent {
  int device = -1;
  EmuStream* stream = nullptr;  // null: never recorded (done, as in CUDA)
  uint64_t seq = 0;
};

}  // namespace

class EmulatedGpu::Impl final : public gpu::Runtime {
 public:
  explicit Impl(EmulatedGpuOptions options) : options_(options) {}
  ~Impl() override {
    std::map<void*, std::unique_ptr<EmuStream>> streams;
    {
      MutexLock lock(&mu_);
      streams.swap(streams_);
    }
    streams.clear();  // finishes queued work first
    MutexLock lock(&mu_);
    for (auto& [addr, a] : allocations_) Unmap(a);
  }

  Backend backend() const override { return Backend::kEmulated; }

  absl::StatusOr<int> DeviceCount() override {
    if (options_.devices <= 0) {
      return absl::UnavailableError("kvwire gpu: no emulated device (configured with 0)");
    }
    return options_.devices;
  }
  absl::StatusOr<gpu::DeviceInfo> GetDeviceInfo(int device) override {
    if (absl::Status s = CheckDevice(device); !s.ok()) return s;
    gpu::DeviceInfo info;
    info.ordinal = device;
    info.name = absl::StrCat("kvwire emulated GPU ", device);
    info.pci_bus_id = "";
    info.numa_node = -1;
    info.total_bytes = uint64_t{1} << 36;
    info.dma_buf = options_.dma_buf;
    return info;
  }

  absl::StatusOr<void*> Allocate(int device, size_t bytes) override {
    if (absl::Status s = CheckDevice(device); !s.ok()) return s;
    const uint64_t size = PageRound(bytes);
    const int fd = memfd_create("kvwire-emulated-gpu", MFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(Errno("kvwire emulated gpu: memfd_create"));
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      const std::string why = Errno("kvwire emulated gpu: ftruncate");
      close(fd);
      return absl::ResourceExhaustedError(why);
    }
    absl::StatusOr<Allocation> a = Map(fd, size, device, /*imported=*/false);
    if (!a.ok()) {
      close(fd);
      return a.status();
    }
    MutexLock lock(&mu_);
    allocations_[a->device_view] = *a;
    return a->device_view;
  }
  void Free(int, void* ptr) override { Release(ptr, /*imported=*/false); }

  absl::StatusOr<void*> AllocatePinnedHost(int device, size_t bytes) override {
    if (absl::Status s = CheckDevice(device); !s.ok()) return s;
    void* p = std::aligned_alloc(4096, PageRound(bytes));
    if (p == nullptr) return absl::ResourceExhaustedError("kvwire emulated gpu: pinned host");
    return p;
  }
  void FreePinnedHost(void* ptr) override { std::free(ptr); }

  absl::StatusOr<gpu::PointerInfo> QueryPointer(const void* ptr) override {
    MutexLock lock(&mu_);
    const Allocation* a = Find(ptr);
    if (a == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("kvwire gpu: 0x",
                                                     absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                                                     " is not emulated device memory"));
    }
    return gpu::PointerInfo{a->device, a->device_view, a->size};
  }

  absl::StatusOr<void*> CreateStream(int device) override {
    if (absl::Status s = CheckDevice(device); !s.ok()) return s;
    auto stream = std::make_unique<EmuStream>(device, options_.copy_delay);
    void* handle = stream.get();
    MutexLock lock(&mu_);
    streams_[handle] = std::move(stream);
    return handle;
  }
  void DestroyStream(int, void* stream) override {
    std::unique_ptr<EmuStream> doomed;
    {
      MutexLock lock(&mu_);
      auto it = streams_.find(stream);
      if (it == streams_.end()) return;
      doomed = std::move(it->second);
      streams_.erase(it);
    }
    // Destroyed outside the lock: its thread finishes queued work, which may translate.
  }
  absl::Status SynchronizeStream(int, void* stream) override {
    EmuStream* s = StreamOf(stream);
    if (s == nullptr) return absl::InvalidArgumentError("kvwire emulated gpu: unknown stream");
    s->WaitFor(s->submitted());
    return absl::OkStatus();
  }

  absl::StatusOr<void*> CreateEvent(int device) override {
    if (absl::Status s = CheckDevice(device); !s.ok()) return s;
    auto event = std::make_unique<EmuEvent>();
    event->device = device;
    void* handle = event.get();
    MutexLock lock(&mu_);
    events_[handle] = std::move(event);
    return handle;
  }
  void DestroyEvent(int, void* event) override {
    MutexLock lock(&mu_);
    events_.erase(event);
  }
  absl::Status RecordEvent(int, void* event, void* stream) override {
    EmuStream* s = StreamOf(stream);
    if (s == nullptr) return absl::InvalidArgumentError("kvwire emulated gpu: unknown stream");
    MutexLock lock(&mu_);
    auto it = events_.find(event);
    if (it == events_.end()) return absl::InvalidArgumentError("kvwire emulated gpu: bad event");
    it->second->stream = s;
    it->second->seq = s->submitted();
    ++counters_.events_recorded;
    return absl::OkStatus();
  }
  absl::Status StreamWaitEvent(int, void* stream, void* event) override {
    EmuStream* s = StreamOf(stream);
    if (s == nullptr) return absl::InvalidArgumentError("kvwire emulated gpu: unknown stream");
    absl::StatusOr<EmuEvent> e = EventOf(event);
    if (!e.ok()) return e.status();
    if (e->stream != nullptr && e->stream != s) {
      EmuStream* other = e->stream;
      const uint64_t seq = e->seq;
      s->Enqueue([other, seq] { other->WaitFor(seq); });
    }
    return absl::OkStatus();
  }
  absl::StatusOr<bool> EventDone(int, void* event) override {
    absl::StatusOr<EmuEvent> e = EventOf(event);
    if (!e.ok()) return e.status();
    return e->stream == nullptr || e->stream->Reached(e->seq);
  }
  absl::Status SynchronizeEvent(int, void* event) override {
    absl::StatusOr<EmuEvent> e = EventOf(event);
    if (!e.ok()) return e.status();
    if (e->stream != nullptr) e->stream->WaitFor(e->seq);
    return absl::OkStatus();
  }

  absl::Status CopyAsync(int, void* dst, const void* src, size_t bytes, void* stream) override {
    EmuStream* s = StreamOf(stream);
    if (s == nullptr) return absl::InvalidArgumentError("kvwire emulated gpu: unknown stream");
    absl::StatusOr<std::byte*> to = Translate(dst, bytes);
    if (!to.ok()) return to.status();
    absl::StatusOr<std::byte*> from = Translate(src, bytes);
    if (!from.ok()) return from.status();
    {
      MutexLock lock(&mu_);
      ++counters_.copies;
      counters_.copy_bytes += bytes;
    }
    const absl::Duration delay = s->copy_delay();
    std::byte* d = *to;
    const std::byte* f = *from;
    s->Enqueue([d, f, bytes, delay] {
      if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
      std::memmove(d, f, bytes);
    });
    return absl::OkStatus();
  }

  absl::StatusOr<gpu::IpcHandle> ExportIpc(int, void* ptr) override {
    if (!options_.ipc) return absl::UnimplementedError("kvwire emulated gpu: IPC export disabled");
    MutexLock lock(&mu_);
    const Allocation* a = Find(ptr);
    if (a == nullptr || a->imported) {
      return absl::InvalidArgumentError(
          "kvwire emulated gpu: IPC export of memory this process did not allocate");
    }
    HandleRecord r{};
    std::memcpy(r.magic, kMagic, sizeof kMagic);
    r.pid = static_cast<int32_t>(getpid());
    r.fd = a->memfd;
    r.size = a->size;
    r.device = a->device;
    gpu::IpcHandle h;
    h.backend = Backend::kEmulated;
    std::memcpy(h.bytes.data(), &r, sizeof r);
    return h;
  }
  absl::StatusOr<void*> OpenIpc(int device, const gpu::IpcHandle& handle) override {
    if (absl::Status s = CheckDevice(device); !s.ok()) return s;
    HandleRecord r{};
    std::memcpy(&r, handle.bytes.data(), sizeof r);
    if (handle.backend != Backend::kEmulated || std::memcmp(r.magic, kMagic, sizeof kMagic) != 0) {
      return absl::InvalidArgumentError("kvwire emulated gpu: not an emulated IPC handle");
    }
    const std::string path = absl::StrCat("/proc/", r.pid, "/fd/", r.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      return absl::InvalidArgumentError(
          Errno(absl::StrCat("kvwire emulated gpu: open ", path).c_str()));
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != r.size) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat("kvwire emulated gpu: IPC handle names ",
                                                     r.size, " B but ", path, " has ", st.st_size));
    }
    absl::StatusOr<Allocation> a = Map(fd, r.size, device, /*imported=*/true);
    if (!a.ok()) {
      close(fd);
      return a.status();
    }
    MutexLock lock(&mu_);
    allocations_[a->device_view] = *a;
    ++counters_.ipc_opens;
    return a->device_view;
  }
  void CloseIpc(int, void* ptr) override { Release(ptr, /*imported=*/true); }

  absl::StatusOr<gpu::DmaBufRange> ExportDmaBuf(int, const void* ptr, size_t bytes) override {
    if (!options_.dma_buf) {
      return absl::UnimplementedError("kvwire emulated gpu: dma-buf export disabled");
    }
    MutexLock lock(&mu_);
    const Allocation* a = Find(ptr);
    if (a == nullptr) {
      return absl::InvalidArgumentError("kvwire emulated gpu: dma-buf of non-device memory");
    }
    const uint64_t offset = static_cast<const std::byte*>(ptr) - a->device_view;
    if (offset + bytes > a->size) {
      return absl::InvalidArgumentError("kvwire emulated gpu: dma-buf range past its allocation");
    }
    const int fd = fcntl(a->memfd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError(Errno("kvwire emulated gpu: dup"));
    return gpu::DmaBufRange{fd, offset, a->size};
  }
  void CloseDmaBuf(int fd) override { close(fd); }

  absl::Status EncodeKvRecords(int, const gpu::KvEncodeArgs& args, void* stream) override {
    EmuStream* s = StreamOf(stream);
    if (s == nullptr) return absl::InvalidArgumentError("kvwire emulated gpu: unknown stream");
    if (absl::Status v = gpu::ValidateKvEncodeArgs(args); !v.ok()) return v;
    if (args.num_tokens == 0) return absl::OkStatus();
    gpu::KvEncodeArgs host = args;
    auto src = Translate(args.src, args.num_tokens * args.src_stride * sizeof(float));
    auto slots = Translate(args.slots, args.num_tokens * sizeof(int64_t));
    const uint64_t pages = (args.num_slots + args.block_size - 1) / args.block_size;
    auto cache = Translate(args.cache, pages * args.page_bytes);
    for (const auto* t : {&src, &slots, &cache}) {
      if (!t->ok()) return t->status();
    }
    host.src = reinterpret_cast<const float*>(*src);
    host.slots = reinterpret_cast<const int64_t*>(*slots);
    host.cache = reinterpret_cast<uint8_t*>(*cache);
    s->Enqueue([host] {
      // Arguments were validated above; a bad slot is the caller's bug, as on a device.
      (void)gpu::EncodeKvRecordsCpu(host);
    });
    return absl::OkStatus();
  }

  // --- for EmulatedGpu --------------------------------------------------------------------------

  // `p` inside a device allocation -> its alias; host memory -> itself. A range that starts in
  // an allocation and runs past it is an error (as a device fault would be).
  absl::StatusOr<std::byte*> Translate(const void* p, size_t bytes) {
    MutexLock lock(&mu_);
    const Allocation* a = Find(p);
    auto* const bp = static_cast<std::byte*>(const_cast<void*>(p));
    if (a == nullptr) return bp;
    const uint64_t offset = bp - a->device_view;
    if (offset + bytes > a->size) {
      return absl::InvalidArgumentError(
          absl::StrCat("kvwire emulated gpu: ", bytes, " B at offset ", offset,
                       " run past the device allocation of ", a->size, " B"));
    }
    return a->alias + offset;
  }
  Counters counters() {
    MutexLock lock(&mu_);
    return counters_;
  }

 private:
  absl::Status CheckDevice(int device) const {
    if (device < 0 || device >= options_.devices) {
      return absl::InvalidArgumentError(absl::StrCat("kvwire emulated gpu: no device ", device,
                                                     " (", options_.devices, " emulated)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Allocation> Map(int fd, uint64_t size, int device, bool imported) {
    void* alias = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (alias == MAP_FAILED) return absl::InternalError(Errno("kvwire emulated gpu: mmap"));
    const int prot = options_.host_accessible ? PROT_READ | PROT_WRITE : PROT_NONE;
    void* view = mmap(nullptr, size, prot, MAP_SHARED, fd, 0);
    if (view == MAP_FAILED) {
      munmap(alias, size);
      return absl::InternalError(Errno("kvwire emulated gpu: mmap"));
    }
    Allocation a;
    a.device = device;
    a.device_view = static_cast<std::byte*>(view);
    a.alias = static_cast<std::byte*>(alias);
    a.size = size;
    a.memfd = fd;
    a.imported = imported;
    return a;
  }
  static void Unmap(const Allocation& a) {
    munmap(a.device_view, a.size);
    munmap(a.alias, a.size);
    close(a.memfd);
  }
  void Release(void* ptr, bool imported) {
    Allocation a;
    {
      MutexLock lock(&mu_);
      auto it = allocations_.find(static_cast<std::byte*>(ptr));
      if (it == allocations_.end() || it->second.imported != imported) return;
      a = it->second;
      allocations_.erase(it);
    }
    Unmap(a);
  }
  const Allocation* Find(const void* p) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto* bp = static_cast<const std::byte*>(p);
    auto it = allocations_.upper_bound(const_cast<std::byte*>(bp));
    if (it == allocations_.begin()) return nullptr;
    --it;
    if (bp >= it->second.device_view + it->second.size) return nullptr;
    return &it->second;
  }
  EmuStream* StreamOf(void* stream) {
    MutexLock lock(&mu_);
    auto it = streams_.find(stream);
    return it == streams_.end() ? nullptr : it->second.get();
  }
  absl::StatusOr<EmuEvent> EventOf(void* event) {
    MutexLock lock(&mu_);
    auto it = events_.find(event);
    if (it == events_.end()) return absl::InvalidArgumentError("kvwire emulated gpu: bad event");
    return *it->second;
  }

  const EmulatedGpuOptions options_;
  Mutex mu_;
  std::map<std::byte*, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  std::map<void*, std::unique_ptr<EmuStream>> streams_ ABSL_GUARDED_BY(mu_);
  std::map<void*, std::unique_ptr<EmuEvent>> events_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

EmulatedGpu::EmulatedGpu(EmulatedGpuOptions options) : impl_(std::make_unique<Impl>(options)) {}
EmulatedGpu::~EmulatedGpu() {
  if (&gpu::DefaultRuntime() == impl_.get()) gpu::SetDefaultRuntime(nullptr);
}

gpu::Runtime& EmulatedGpu::runtime() { return *impl_; }

absl::Status EmulatedGpu::WriteDevice(void* device_ptr, const void* src, size_t bytes) {
  absl::StatusOr<std::byte*> to = impl_->Translate(device_ptr, bytes);
  if (!to.ok()) return to.status();
  std::memcpy(*to, src, bytes);
  return absl::OkStatus();
}
absl::Status EmulatedGpu::ReadDevice(void* dst, const void* device_ptr, size_t bytes) {
  absl::StatusOr<std::byte*> from = impl_->Translate(device_ptr, bytes);
  if (!from.ok()) return from.status();
  std::memcpy(dst, *from, bytes);
  return absl::OkStatus();
}

EmulatedGpu::Counters EmulatedGpu::counters() const { return impl_->counters(); }

}  // namespace kvwire::testing
