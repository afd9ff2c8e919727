#include "transport/shm/shareable_registry.h"

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fcntl.h>
#include <map>
#include <optional>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "src/util/mutex.h"
#include "src/util/pinned_ranges.h"
#include "transport/shm/errno_text.h"
#include "transport/shm/write_guard.h"

namespace kvwire::transport {
namespace {

using shm::ErrnoStatus;

struct Entry {
  size_t size = 0;
  int fd = -1;
  uint64_t serial = 0;
  uint32_t slot = shm::kNoEpochSlot;
  uint64_t epoch = 0;
};

// Copies the populated parts of `fd` (holes stay holes) from the owner's mapping at `base`
// into `to`, which is as large and all holes. pwrite of whole extents: the kernel allocates
// the new pages as it copies, which measured about twice as fast as fallocate then memcpy
// through a mapping of `to` (page faults), and faster than a first-touch memcpy.
absl::Status CopyData(int fd, const std::byte* base, size_t size, int to) {
  off_t at = 0;
  while (static_cast<size_t>(at) < size) {
    const off_t data = ::lseek(fd, at, SEEK_DATA);
    if (data < 0) {
      if (errno == ENXIO) return absl::OkStatus();  // only holes from here on
      return ErrnoStatus(absl::StatusCode::kInternal, errno, "lseek(SEEK_DATA) of the memfd");
    }
    off_t hole = ::lseek(fd, data, SEEK_HOLE);
    if (hole < 0) hole = static_cast<off_t>(size);
    off_t done = data;
    while (done < hole) {
      const ssize_t wrote = ::pwrite(to, base + done, static_cast<size_t>(hole - done), done);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0) {
        return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno,
                           absl::StrCat("copying ", hole - done, " bytes into the new memfd"));
      }
      done += wrote;
    }
    at = hole;
  }
  return absl::OkStatus();
}

class Registry {
 public:
  void Add(uintptr_t base, size_t size, int fd) {
    MutexLock lock(&mu_);
    entries_[base] = Entry{size, fd, ++last_serial_};
  }
  void Remove(uintptr_t base) {
    MutexLock lock(&mu_);
    auto it = entries_.find(base);
    if (it == entries_.end()) return;
    // A peer still mapping the buffer sees its word change: its next copy refetches, and
    // finds the buffer gone.
    if (it->second.slot != shm::kNoEpochSlot) {
      Publish(it->second.slot);
      free_slots_.push_back(it->second.slot);
    }
    entries_.erase(it);
  }
  std::optional<ShareableBacking> Find(uintptr_t ptr, size_t length) {
    MutexLock lock(&mu_);
    auto it = FindLocked(ptr, length);
    if (it == entries_.end()) return std::nullopt;
    return ShareableBacking{it->second.fd, ptr - it->first, it->second.serial};
  }

  std::optional<shm::ShareableRange> Range(uintptr_t ptr) {
    MutexLock lock(&mu_);
    auto it = FindLocked(ptr, 0);
    if (it == entries_.end()) return std::nullopt;
    return shm::ShareableRange{reinterpret_cast<std::byte*>(it->first), it->second.size};
  }

  absl::StatusOr<std::optional<shm::ShareableDup>> Dup(uintptr_t ptr, size_t length,
                                                       uint64_t serial, bool with_epoch) {
    MutexLock lock(&mu_);
    auto it = FindLocked(ptr, length);
    if (it == entries_.end() || (serial != 0 && it->second.serial != serial)) return std::nullopt;
    Entry& entry = it->second;
    if (with_epoch && entry.slot == shm::kNoEpochSlot) {
      if (absl::Status table = MakeTableLocked(); !table.ok()) return table;
      if (free_slots_.empty() && next_slot_ == shm::kEpochSlots) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "shm: all ", shm::kEpochSlots, " epoch slots are taken by shared buffers"));
      }
      if (!free_slots_.empty()) {
        entry.slot = free_slots_.back();
        free_slots_.pop_back();
      } else {
        entry.slot = next_slot_++;
      }
      entry.epoch = Publish(entry.slot);
    }
    shm::ShareableDup dup;
    dup.fd.Reset(::fcntl(entry.fd, F_DUPFD_CLOEXEC, 0));
    if (!dup.fd.valid()) {
      return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "duplicating a memfd");
    }
    dup.offset = ptr - it->first;
    dup.size = entry.size;
    dup.epoch_slot = entry.slot;
    dup.epoch = entry.epoch;
    return dup;
  }

  absl::Status Reback(uintptr_t ptr, shm::MoveGuard guard) {
    MutexLock lock(&mu_);
    auto it = FindLocked(ptr, 0);
    if (it == entries_.end()) {
      return absl::NotFoundError(
          absl::StrCat("shm: no live ShareableBuffer at 0x", absl::Hex(ptr)));
    }
    Entry& entry = it->second;
    std::byte* const base = reinterpret_cast<std::byte*>(it->first);
    if (AnyPinned(base, entry.size)) {
      // A device (an rdma MR) holds the pages: moving the range would leave it on the old
      // memfd, where the revoked peer is. Not moved; said loudly (SECURITY-shm.md).
      return absl::FailedPreconditionError(
          "the buffer is registered with a device that pinned its pages (rdma), which would "
          "keep using the old memfd: not moved");
    }
    const int seals = ::fcntl(entry.fd, F_GET_SEALS);
    if (seals < 0) return ErrnoStatus(absl::StatusCode::kInternal, errno, "F_GET_SEALS");
    shm::UniqueFd fresh(::memfd_create("kvwire-reback", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fresh.valid()) {
      return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "memfd_create");
    }
    if (::ftruncate(fresh.get(), static_cast<off_t>(entry.size)) != 0 ||
        ::fcntl(fresh.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
      return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno,
                         absl::StrCat("sizing and sealing a new memfd of ", entry.size, " bytes"));
    }
    // The owner's own writes into the range wait from here until the new memfd is mapped over
    // it (write_guard.h): none lands in the old memfd after its page was copied. Nothing below
    // writes into the range (the copy only reads it), or this thread would wait on itself.
    std::optional<shm::WriteGuard> held;
    if (absl::StatusOr<shm::WriteGuard> armed = shm::WriteGuard::Arm(base, entry.size);
        armed.ok()) {
      held.emplace(*std::move(armed));
    } else if (guard == shm::MoveGuard::kRequired) {
      return absl::FailedPreconditionError(
          absl::StrCat("the application's writes into the buffer cannot be held off during a "
                       "move (",
                       armed.status().message(), "): not moved"));
    } else if (shm::WriteGuardAvailable().ok()) {
      // Available, yet refused for this range: said, and moved as without the guard.
      KVW_LOG(kWarning, "shm") << "moving a buffer without the write guard: the application's "
                                  "writes during the move may be lost"
                               << Kv("error", armed.status());
    }
    // Peers that copy from now on redo their copy on the new memfd (see the header); the
    // fence orders this store before the reads of the copy below.
    if (entry.slot != shm::kNoEpochSlot) entry.epoch = Publish(entry.slot);
    if (absl::Status copied = CopyData(entry.fd, base, entry.size, fresh.get()); !copied.ok()) {
      if (held.has_value()) held->Lift();  // the old memfd stays the owner's: writable again
      return copied;
    }
    if (::mmap(base, entry.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fresh.get(), 0) ==
        MAP_FAILED) {
      // The range may be unmapped now (mmap(2)): the owner's memory is gone; stop here rather
      // than let it run on with a hole where its buffer was.
      KVW_LOG(kError, "shm") << "mmap MAP_FIXED over a ShareableBuffer failed"
                             << Kv("error", shm::ErrnoText(errno));
      std::abort();
    }
    // The held writers retry their faults, which now find the new memfd's mapping.
    const bool guarded = held.has_value();
    held.reset();
    // The old memfd's seals, now that the owner's writable mapping exists (F_SEAL_FUTURE_WRITE
    // forbids new ones).
    const int carried = seals & (F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
    if (carried != 0 && ::fcntl(fresh.get(), F_ADD_SEALS, carried) != 0) {
      // Not shared read-only from now on: the fd server checks the seals before it serves.
      KVW_LOG(kError, "shm") << "sealing the new memfd failed"
                             << Kv("error", shm::ErrnoText(errno));
    }
    // The new memfd takes the old one's number: the ShareableBuffer closes it in the end, and
    // fd() names the memory the owner really has.
    while (::dup3(fresh.get(), entry.fd, O_CLOEXEC) < 0) {
      if (errno != EINTR && errno != EBUSY) {
        // The registry and the buffer would name a memfd that is not the owner's memory.
        KVW_LOG(kError, "shm") << "dup3 onto the old memfd's number failed"
                               << Kv("error", shm::ErrnoText(errno));
        std::abort();
      }
    }
    if (entry.slot != shm::kNoEpochSlot) entry.epoch = Publish(entry.slot);
    // Release: a caller that sees the count go up (a test, after a peer's close moved the
    // buffer on the transport's thread) also sees the owner's range mapped over.
    if (guarded) guarded_rebacks_.fetch_add(1, std::memory_order_relaxed);
    rebacks_.fetch_add(1, std::memory_order_release);
    return absl::OkStatus();
  }

  absl::StatusOr<int> TableFd() {
    MutexLock lock(&mu_);
    if (absl::Status table = MakeTableLocked(); !table.ok()) return table;
    return table_fd_;
  }

  uint64_t rebacks() const { return rebacks_.load(std::memory_order_acquire); }
  uint64_t guarded_rebacks() const { return guarded_rebacks_.load(std::memory_order_acquire); }

 private:
  std::map<uintptr_t, Entry>::iterator FindLocked(uintptr_t ptr, size_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // The last buffer starting at or below `ptr` is the only one that can contain it: live
    // buffers are distinct mappings and never overlap.
    auto it = entries_.upper_bound(ptr);
    if (it == entries_.begin()) return entries_.end();
    --it;
    const uintptr_t offset = ptr - it->first;
    const Entry& entry = it->second;
    if (offset >= entry.size || length > entry.size - offset) return entries_.end();
    return it;
  }

  // Stores a value never used before in `slot`, then a full fence; returns the value.
  uint64_t Publish(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint64_t value = ++last_epoch_;
    __atomic_store_n(&table_[slot], value, __ATOMIC_SEQ_CST);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return value;
  }

  absl::Status MakeTableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (table_ != nullptr) return absl::OkStatus();
    shm::UniqueFd fd(::memfd_create("kvwire-epochs", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd.valid() || ::ftruncate(fd.get(), static_cast<off_t>(shm::kEpochTableBytes)) != 0) {
      return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "shm epoch table memfd");
    }
    void* map =
        ::mmap(nullptr, shm::kEpochTableBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (map == MAP_FAILED) {
      return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "mapping the epoch table");
    }
    // Peers may read it only: no holder can write, resize or reseal it; this mapping stays
    // writable.
    if (::fcntl(fd.get(), F_ADD_SEALS,
                F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
      const int error = errno;
      ::munmap(map, shm::kEpochTableBytes);
      return ErrnoStatus(absl::StatusCode::kInternal, error, "sealing the epoch table");
    }
    table_ = static_cast<uint64_t*>(map);
    table_fd_ = fd.Release();
    return absl::OkStatus();
  }

  Mutex mu_;
  std::map<uintptr_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t* table_ ABSL_GUARDED_BY(mu_) = nullptr;  // never unmapped
  int table_fd_ ABSL_GUARDED_BY(mu_) = -1;          // never closed
  uint32_t next_slot_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint32_t> free_slots_ ABSL_GUARDED_BY(mu_);
  uint64_t last_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_serial_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> rebacks_{0};
  std::atomic<uint64_t> guarded_rebacks_{0};
};

Registry& GetRegistry() {
  // Never destroyed (static objects must be trivially destructible): buffers released by
  // other static destructors at exit can still unregister.
  static Registry* const registry = new Registry();
  return *registry;
}

}  // namespace

std::optional<ShareableBacking> FindShareable(const void* ptr, size_t length) {
  return GetRegistry().Find(reinterpret_cast<uintptr_t>(ptr), length);
}

namespace shm {

absl::StatusOr<std::optional<ShareableDup>> DupShareable(const void* ptr, size_t length,
                                                         uint64_t buffer, bool with_epoch) {
  return GetRegistry().Dup(reinterpret_cast<uintptr_t>(ptr), length, buffer, with_epoch);
}

absl::Status RebackShareable(const void* ptr, MoveGuard guard) {
  return GetRegistry().Reback(reinterpret_cast<uintptr_t>(ptr), guard);
}

std::optional<ShareableRange> FindShareableRange(const void* ptr) {
  return GetRegistry().Range(reinterpret_cast<uintptr_t>(ptr));
}

uint64_t RebackCount() { return GetRegistry().rebacks(); }

uint64_t GuardedRebackCount() { return GetRegistry().guarded_rebacks(); }

absl::StatusOr<int> EpochTableFd() { return GetRegistry().TableFd(); }

void RegisterShareable(const void* base, size_t size, int fd) {
  GetRegistry().Add(reinterpret_cast<uintptr_t>(base), size, fd);
}

void UnregisterShareable(const void* base) {
  GetRegistry().Remove(reinterpret_cast<uintptr_t>(base));
}

}  // namespace shm
}  // namespace kvwire::transport
