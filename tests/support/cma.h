// Cross-memory attach (process_vm_readv/writev) in tests: whether the kernel allows it here,
// decided once per test process by a real probe and printed loudly, so that the shm tests
// REQUIRE the CMA path where it is allowed (a CMA path that fails is then a failure, never a
// quiet fall back); and a seccomp filter that refuses it on purpose, so that the refusal path
// is tested deliberately rather than by the accident of a hardened kernel.
#ifndef KVWIRE_TESTS_SUPPORT_CMA_H_
#define KVWIRE_TESTS_SUPPORT_CMA_H_

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <signal.h>
#include <string>
#include <unistd.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvwire::testing {

struct CmaVerdict {
  bool allowed = false;
  std::string why;  // the kernel's refusal, when refused
};

// Whether this process may read the memory of a child it forked (the relation of a test and
// its peer process, and of the shm initiator and a target it forked) with process_vm_readv.
// Probed once; the verdict is printed to stderr.
inline const CmaVerdict& CmaHere() {
  static const CmaVerdict verdict = [] {
    CmaVerdict v;
    static volatile uint64_t probe_word = 0;
    probe_word = 0x6b7677697265636dull ^ static_cast<uint64_t>(getpid());
    int hold[2];
    if (pipe(hold) != 0) {
      v.why = absl::StrCat("pipe: ", std::strerror(errno));
      return v;
    }
    const pid_t child = fork();
    if (child == 0) {  // waits (the same word at the same address) until the parent is done
      close(hold[1]);
      char c;
      while (read(hold[0], &c, 1) < 0 && errno == EINTR) {
      }
      _exit(0);
    }
    close(hold[0]);
    if (child < 0) {
      v.why = absl::StrCat("fork: ", std::strerror(errno));
      close(hold[1]);
      return v;
    }
    uint64_t copy = 0;
    iovec local{&copy, sizeof(copy)};
    iovec remote{const_cast<uint64_t*>(&probe_word), sizeof(copy)};
    const ssize_t n = process_vm_readv(child, &local, 1, &remote, 1, 0);
    const int err = errno;
    close(hold[1]);
    int status = 0;
    waitpid(child, &status, 0);
    if (n == static_cast<ssize_t>(sizeof(copy)) && copy == probe_word) {
      v.allowed = true;
    } else {
      v.why = n < 0 ? absl::StrCat("process_vm_readv: ", std::strerror(err))
                    : absl::StrCat("process_vm_readv read ", n, " bytes, 0x", absl::Hex(copy));
    }
    std::fprintf(stderr,
                 v.allowed
                     ? "*** CMA probe: cross-memory attach to a child is ALLOWED here: every shm "
                       "CMA path is required to work%s\n"
                     : "*** CMA probe: cross-memory attach is REFUSED here (%s): the shm tests "
                       "check the refusal instead of the CMA path\n",
                 v.why.c_str());
    return v;
  }();
  return verdict;
}

// Installs, in every thread of this process (TSYNC), a seccomp filter under which
// process_vm_readv and process_vm_writev fail with EPERM, as a hardened sandbox would. For
// a process of its own (a death-test child): a filter cannot be removed.
inline absl::Status DenyCmaBySeccomp() {
#if defined(__x86_64__)
  constexpr uint32_t kArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
  constexpr uint32_t kArch = AUDIT_ARCH_AARCH64;
#else
  return absl::UnimplementedError("DenyCmaBySeccomp: unknown architecture");
#endif
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_readv, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_writev, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    return absl::InternalError(absl::StrCat("PR_SET_NO_NEW_PRIVS: ", std::strerror(errno)));
  }
  if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog) != 0) {
    return absl::InternalError(absl::StrCat("seccomp: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_CMA_H_
