// How a child process of a test ended, judged the same way by every harness that starts one
// (tests/perf, tests/rdma, tests/unit/shm, ...): a child's end is part of the test that ran it.
// Under ASan/UBSan/TSan a report makes the child exit non-zero (the Makefile's *SAN_OPTIONS
// set halt_on_error; the build sets -fno-sanitize-recover=all), so "exited 0" is the only
// clean end unless the test itself sent the signal that ended it.
#ifndef KVWIRE_TESTS_SUPPORT_CHILD_END_H_
#define KVWIRE_TESTS_SUPPORT_CHILD_END_H_

#include <sys/types.h>
#include <sys/wait.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvwire::testing {

// Empty when the waitpid() `status` is a clean end: exit 0, or death by `expected_signal`
// (a signal the test sent on purpose; 0: none). Otherwise what went wrong, for a failure.
inline std::string BadEnd(int status, int expected_signal = 0) {
  if (WIFSIGNALED(status) && WTERMSIG(status) != expected_signal) {
    return absl::StrCat("died of signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)),
                        ") that the test did not send");
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
    return absl::StrCat("exited with status ", WEXITSTATUS(status),
                        " (a sanitizer report, a leak or a failed check; see its output)");
  }
  return "";
}

// Reaps `pid`, waiting at most `grace` for it to exit by itself (SIGKILL after, which is a
// failure: a child that has to be killed hung). Returns BadEnd's verdict, or why it was killed.
inline std::string ReapAndJudge(pid_t pid, absl::Duration grace, int expected_signal = 0) {
  const absl::Time deadline = absl::Now() + grace;
  int status = 0;
  pid_t r;
  while ((r = waitpid(pid, &status, WNOHANG)) == 0) {
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return absl::StrCat("did not exit within ", absl::FormatDuration(grace), " and was killed");
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  if (r < 0) return absl::StrCat("waitpid(", pid, "): ", std::strerror(errno));
  return BadEnd(status, expected_signal);
}

// A child the test ends on purpose with SIGKILL (a server that waits forever): if it had
// already ended by itself, that end is judged; otherwise the kill is the test's and is clean.
inline std::string KillAndJudge(pid_t pid) {
  int status = 0;
  const pid_t r = waitpid(pid, &status, WNOHANG);
  if (r == pid) return BadEnd(status);
  if (r < 0) return absl::StrCat("waitpid(", pid, "): ", std::strerror(errno));
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return BadEnd(status, SIGKILL);
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_CHILD_END_H_
