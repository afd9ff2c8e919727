#include "transport/shm/write_guard.h"

#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>
#include <utility>

#include "absl/strings/str_cat.h"

#include "transport/shm/errno_text.h"

namespace kvwire::transport::shm {
namespace {

std::atomic<bool> g_disabled_for_testing{false};

struct Uffd {
  UniqueFd fd;
  bool user_mode_only = false;
};

// A userfaultfd with shmem write-protection enabled (UFFDIO_API done), or why not.
absl::StatusOr<Uffd> OpenUffd() {
  Uffd uffd;
  uffd.fd.Reset(static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC)));
  if (!uffd.fd.valid() && errno == EPERM) {
    // vm.unprivileged_userfaultfd=0 without CAP_SYS_PTRACE (or a seccomp filter): a
    // user-mode-only one may still be allowed (Linux 5.11+).
    uffd.fd.Reset(static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY)));
    uffd.user_mode_only = true;
  }
  if (!uffd.fd.valid()) {
    return ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno, "userfaultfd(2)");
  }
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = UFFD_FEATURE_WP_HUGETLBFS_SHMEM;
  if (::ioctl(uffd.fd.get(), UFFDIO_API, &api) != 0) {
    // EINVAL: the kernel lacks the feature (before 5.19, or without
    // CONFIG_PTE_MARKER_UFFD_WP, which clears it).
    return ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno,
                       "userfaultfd write-protection of shmem "
                       "(UFFD_FEATURE_WP_HUGETLBFS_SHMEM, Linux 5.19+)");
  }
  return uffd;
}

absl::Status WriteProtect(int uffd, void* base, size_t size, bool protect) {
  uffdio_writeprotect wp{};
  wp.range.start = reinterpret_cast<uintptr_t>(base);
  wp.range.len = size;
  // Unprotecting wakes the waiters of the range too (no UFFDIO_WRITEPROTECT_MODE_DONTWAKE).
  wp.mode = protect ? UFFDIO_WRITEPROTECT_MODE_WP : 0;
  while (::ioctl(uffd, UFFDIO_WRITEPROTECT, &wp) != 0) {
    // EAGAIN: the mm's layout is changing under a non-cooperative event; try again.
    if (errno == EINTR || errno == EAGAIN) continue;
    return ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno, "UFFDIO_WRITEPROTECT");
  }
  return absl::OkStatus();
}

struct Probe {
  absl::Status status;
  bool user_mode_only = false;
};

// Arms a guard on a fresh two-page memfd mapping (one page written, one never touched: the
// second needs the kernel's pte markers) and lifts it.
Probe RunProbe() {
  Probe probe;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  UniqueFd memfd(::memfd_create("kvwire-guard-probe", MFD_CLOEXEC));
  if (!memfd.valid() || ::ftruncate(memfd.get(), static_cast<off_t>(2 * page)) != 0) {
    probe.status =
        ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno, "write guard probe memfd");
    return probe;
  }
  void* map = ::mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (map == MAP_FAILED) {
    probe.status =
        ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno, "write guard probe mmap");
    return probe;
  }
  std::memset(map, 1, page);
  absl::StatusOr<Uffd> uffd = OpenUffd();
  if (!uffd.ok()) {
    probe.status = uffd.status();
  } else {
    probe.user_mode_only = uffd->user_mode_only;
    uffdio_register reg{};
    reg.range.start = reinterpret_cast<uintptr_t>(map);
    reg.range.len = 2 * page;
    reg.mode = UFFDIO_REGISTER_MODE_WP;
    if (::ioctl(uffd->fd.get(), UFFDIO_REGISTER, &reg) != 0) {
      probe.status = ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno,
                                 "UFFDIO_REGISTER_MODE_WP on a memfd mapping");
    } else if ((reg.ioctls & (uint64_t{1} << _UFFDIO_WRITEPROTECT)) == 0) {
      probe.status = absl::FailedPreconditionError(
          "userfaultfd: UFFDIO_WRITEPROTECT not offered on a memfd mapping");
    } else {
      probe.status = WriteProtect(uffd->fd.get(), map, 2 * page, true);
      if (probe.status.ok()) probe.status = WriteProtect(uffd->fd.get(), map, 2 * page, false);
    }
  }
  ::munmap(map, 2 * page);
  return probe;
}

const Probe& CachedProbe() {
  static const Probe* const probe = new Probe(RunProbe());
  return *probe;
}

}  // namespace

absl::Status WriteGuardAvailable() {
  if (g_disabled_for_testing.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError("the write guard is disabled by a test hook");
  }
  return CachedProbe().status;
}

std::string WriteGuardMode() {
  if (!WriteGuardAvailable().ok()) return "";
  return CachedProbe().user_mode_only
             ? "userfaultfd write-protect, user-mode faults only (a kernel write into a buffer "
               "during its move fails with EFAULT)"
             : "userfaultfd write-protect";
}

void SetWriteGuardDisabledForTesting(bool disabled) {
  g_disabled_for_testing.store(disabled, std::memory_order_release);
}

absl::StatusOr<WriteGuard> WriteGuard::Arm(void* base, size_t size) {
  if (absl::Status available = WriteGuardAvailable(); !available.ok()) return available;
  absl::StatusOr<Uffd> uffd = OpenUffd();
  if (!uffd.ok()) return uffd.status();
  uffdio_register reg{};
  reg.range.start = reinterpret_cast<uintptr_t>(base);
  reg.range.len = size;
  reg.mode = UFFDIO_REGISTER_MODE_WP;
  if (::ioctl(uffd->fd.get(), UFFDIO_REGISTER, &reg) != 0) {
    return ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno,
                       absl::StrCat("UFFDIO_REGISTER_MODE_WP of ", size, " bytes"));
  }
  // From here on the guard owns the registration: closing the userfaultfd undoes it.
  WriteGuard guard(std::move(uffd->fd), base, size);
  if (absl::Status wp = WriteProtect(guard.uffd_.get(), base, size, true); !wp.ok()) {
    guard.Lift();
    return wp;
  }
  return guard;
}

void WriteGuard::Wake() {
  if (!uffd_.valid()) return;
  // Every waiter of the range, now: the last close would wake them too, but a copy of the
  // descriptor inherited by a child forked meanwhile would delay that close.
  uffdio_range range{};
  range.start = reinterpret_cast<uintptr_t>(base_);
  range.len = size_;
  while (::ioctl(uffd_.get(), UFFDIO_WAKE, &range) != 0 && errno == EINTR) {
  }
  uffd_.Reset();
}

void WriteGuard::Lift() {
  if (!uffd_.valid()) return;
  // Best effort: the kernel treats a leftover write-protect bit of an unregistered mapping as
  // an ordinary write fault.
  (void)WriteProtect(uffd_.get(), base_, size_, false);
  // Unregistered here, not at the close: a copy of the descriptor inherited by a child forked
  // meanwhile would keep the range registered, and the next move's Arm of the same range
  // would fail (EBUSY) until that child exits.
  uffdio_range range{};
  range.start = reinterpret_cast<uintptr_t>(base_);
  range.len = size_;
  while (::ioctl(uffd_.get(), UFFDIO_UNREGISTER, &range) != 0 && errno == EINTR) {
  }
  Wake();
}

WriteGuard::~WriteGuard() { Wake(); }

}  // namespace kvwire::transport::shm
