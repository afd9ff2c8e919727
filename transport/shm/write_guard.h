// Holds the application's own writes off a ShareableBuffer while it moves onto a fresh memfd
// (RebackShareable, shareable_registry.h), so that none of them lands in the memfd being given
// up after that page was copied.
//
// userfaultfd write-protection of the owner's range: Arm registers the range with a new
// userfaultfd (UFFDIO_REGISTER_MODE_WP) and write-protects it (UFFDIO_WRITEPROTECT). A thread
// that writes into it from then on takes a write-protect fault and sleeps in the kernel; nobody
// reads the userfaultfd, so it sleeps until the guard goes. The mover copies, maps the fresh
// memfd over the range (MAP_FIXED, which replaces the registered mapping), and destroys the
// guard: it wakes every waiter (UFFDIO_WAKE, then the last close of the userfaultfd wakes any
// left), and each retries its fault, which now finds the new mapping and lands in the new
// memfd. A waiter gives up the mmap lock before it sleeps (handle_userfault), so the MAP_FIXED
// does not wait for it. No signal handlers; nothing runs on the writer's side.
//
// Needs Linux 5.19+ built with CONFIG_PTE_MARKER_UFFD_WP (UFFD_FEATURE_WP_HUGETLBFS_SHMEM:
// write-protection of shmem, including pages not mapped yet), and the right to create a
// userfaultfd: root or CAP_SYS_PTRACE, or vm.unprivileged_userfaultfd=1; otherwise (the
// default sysctl 0, Linux 5.11+) a user-mode-only one, under which a write the kernel makes
// into the buffer for the owner during a move (a read(2) into it) fails with EFAULT instead of
// waiting. Probed once per process (WriteGuardAvailable), by write-protecting a page.
#ifndef KVWIRE_TRANSPORT_SHM_WRITE_GUARD_H_
#define KVWIRE_TRANSPORT_SHM_WRITE_GUARD_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "transport/shm/unique_fd.h"

namespace kvwire::transport::shm {

// OK when Arm can work in this process; else why not (FailedPrecondition). The first call
// probes and caches the answer. Thread-safe.
absl::Status WriteGuardAvailable();

// How the guard works here, for logs: "userfaultfd write-protect" and whether kernel-mode
// writes wait too. Empty when unavailable.
std::string WriteGuardMode();

// Test hook: makes WriteGuardAvailable() fail (and Arm with it), as on a kernel without
// write-protection of shmem. Process-wide; set it before the engines whose behaviour it
// should change are created (the shm transport reads availability when it starts).
void SetWriteGuardDisabledForTesting(bool disabled);

class WriteGuard {
 public:
  // Write-protects [base, base + size): page-aligned, all of one MAP_SHARED shmem mapping of
  // this process. Returns with every later write into the range held in the kernel until the
  // guard is destroyed. Fails (nothing protected) when unavailable or refused.
  static absl::StatusOr<WriteGuard> Arm(void* base, size_t size);

  WriteGuard(WriteGuard&& other) noexcept = default;
  WriteGuard& operator=(WriteGuard&& other) noexcept = delete;
  WriteGuard(const WriteGuard&) = delete;
  WriteGuard& operator=(const WriteGuard&) = delete;
  // Wakes the held writers: each retries its write against whatever maps the range now.
  ~WriteGuard();

  // When the range was NOT mapped over (the move failed): lifts the write-protection first, so
  // that the held writers retry into the same mapping, writable again, and unregisters the
  // range. Then as the destructor. Only while the range is still this guard's mapping: after
  // a remap the range could be registered by another userfaultfd of the process, which older
  // kernels would let this one unregister.
  void Lift();

 private:
  WriteGuard(UniqueFd uffd, void* base, size_t size)
      : uffd_(std::move(uffd)), base_(base), size_(size) {}
  void Wake();

  UniqueFd uffd_;
  void* base_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_WRITE_GUARD_H_
