#include "transport/shm/cma.h"

#include <algorithm>
#include <cerrno>
#include <fcntl.h>
#include <string>
#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#include "transport/shm/errno_text.h"
#include "transport/shm/unique_fd.h"

namespace kvwire::transport::shm {
namespace {

// Why the kernel may refuse with EPERM, for the message.
std::string PtraceHint() {
  UniqueFd fd(::open("/proc/sys/kernel/yama/ptrace_scope", O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    return "no Yama LSM; the ptrace access check failed (different uid, no CAP_SYS_PTRACE, "
           "or a seccomp/LSM policy)";
  }
  char buffer[16];
  const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
  const std::string scope(
      absl::StripAsciiWhitespace(absl::string_view(buffer, n > 0 ? static_cast<size_t>(n) : 0)));
  if (scope == "0") return "kernel.yama.ptrace_scope=0; different uid or no CAP_SYS_PTRACE?";
  if (scope == "1") {
    return "kernel.yama.ptrace_scope=1 (only ancestors may attach); set it to 0, or give "
           "CAP_SYS_PTRACE";
  }
  return absl::StrCat("kernel.yama.ptrace_scope=", scope, " (attach restricted to admin or off)");
}

}  // namespace

absl::Status ProbeCma(pid_t pid, uint64_t address, uint64_t expected) {
  uint64_t value = 0;
  iovec local{&value, sizeof(value)};
  iovec remote{reinterpret_cast<void*>(address), sizeof(value)};
  ssize_t n;
  do {
    n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    const int err = errno;
    std::string why = absl::StrCat("process_vm_readv of pid ", pid, ": ", ErrnoText(err));
    if (err == EPERM) absl::StrAppend(&why, "; ", PtraceHint());
    if (err == ESRCH) absl::StrAppend(&why, "; no such process here (another pid namespace?)");
    if (err == ENOSYS) absl::StrAppend(&why, "; the kernel lacks CONFIG_CROSS_MEMORY_ATTACH");
    return absl::FailedPreconditionError(why);
  }
  if (n != static_cast<ssize_t>(sizeof(value)) || value != expected) {
    return absl::FailedPreconditionError(
        absl::StrCat("process_vm_readv of pid ", pid, " read ", n, " bytes 0x", absl::Hex(value),
                     " instead of the probe word 0x", absl::Hex(expected),
                     " (pid names another process: another pid namespace?)"));
  }
  return absl::OkStatus();
}

void CmaBatch::Add(size_t op_index, std::byte* local, uint64_t remote_address, uint64_t length) {
  local_[count_] = iovec{local, static_cast<size_t>(length)};
  remote_[count_] = iovec{reinterpret_cast<void*>(remote_address), static_cast<size_t>(length)};
  op_index_[count_] = op_index;
  ++count_;
}

absl::Status CmaBatch::Flush(size_t* failed_op) {
  size_t first = 0;  // the first op not yet moved completely
  while (first < count_) {
    const unsigned long n_iov = count_ - first;
    const ssize_t moved =
        kind_ == OpKind::kWrite
            ? ::process_vm_writev(pid_, local_ + first, n_iov, remote_ + first, n_iov, 0)
            : ::process_vm_readv(pid_, local_ + first, n_iov, remote_ + first, n_iov, 0);
    if (moved < 0 && errno == EINTR) continue;
    if (moved <= 0) {
      // A partial transfer stops at the failing op; retrying it reports why.
      const int err = moved < 0 ? errno : 0;
      *failed_op = op_index_[first];
      count_ = 0;
      const char* call = kind_ == OpKind::kWrite ? "process_vm_writev" : "process_vm_readv";
      if (err == 0) {
        return absl::InternalError(absl::StrCat(call, " of pid ", pid_, " made no progress"));
      }
      std::string why = absl::StrCat(call, " of pid ", pid_, ": ", ErrnoText(err));
      if (err == EFAULT) absl::StrAppend(&why, " (the peer's range is not mapped any more?)");
      if (err == ESRCH) absl::StrAppend(&why, " (the peer process is gone)");
      return absl::Status(
          err == ESRCH ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal, why);
    }
    // Local and remote iovecs pair up with equal lengths, so both advance alike.
    size_t left = static_cast<size_t>(moved);
    while (left > 0 && first < count_) {
      const size_t step = std::min(left, local_[first].iov_len);
      local_[first].iov_base = static_cast<std::byte*>(local_[first].iov_base) + step;
      local_[first].iov_len -= step;
      remote_[first].iov_base = static_cast<std::byte*>(remote_[first].iov_base) + step;
      remote_[first].iov_len -= step;
      left -= step;
      if (local_[first].iov_len == 0) ++first;
    }
  }
  count_ = 0;
  return absl::OkStatus();
}

}  // namespace kvwire::transport::shm
