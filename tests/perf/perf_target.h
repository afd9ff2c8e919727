// The kvwire-perf target process of the two-process perf tests, and the initiator run, shared
// by perf_run_test, perf_secret_test and perf_side_channel_test. The target's end is judged
// (tests/support/child_end.h): one that exits non-zero (a sanitizer report in it, a failed
// check) or dies of a signal fails the test, also when the test did not wait for it.
#ifndef KVWIRE_TESTS_PERF_PERF_TARGET_H_
#define KVWIRE_TESTS_PERF_PERF_TARGET_H_

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

#include "tests/support/child_end.h"

namespace kvwire::testing {

// The target process; its stdout is read until it says which side-channel port it took.
class PerfTarget {
 public:
  explicit PerfTarget(const std::vector<std::string>& args) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      std::vector<std::string> all = {KVWIRE_PERF_BIN, "-p", "0"};
      all.insert(all.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (std::string& a : all) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    out_ = out[0];
    // Until the port line, within 60 s (the target's start under a sanitizer included).
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    size_t at;
    while ((at = output_.find("waiting on port ")) == std::string::npos ||
           output_.find('\n', at) == std::string::npos) {
      if (!ReadSome(deadline)) return;
    }
    const size_t digits = at + 16;
    (void)absl::SimpleAtoi(
        output_.substr(digits, output_.find_first_not_of("0123456789", digits) - digits), &port_);
  }
  // A target the test did not wait for still waits for initiators: the test ends it with
  // SIGKILL. If it had ended by itself already, that end is judged.
  ~PerfTarget() {
    if (pid_ > 0) {
      const std::string problem = KillAndJudge(pid_);
      if (!problem.empty()) ADD_FAILURE() << "kvwire-perf target " << pid_ << " " << problem;
    }
    if (out_ >= 0) close(out_);
  }
  PerfTarget(const PerfTarget&) = delete;
  PerfTarget& operator=(const PerfTarget&) = delete;

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  bool Alive() const { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }
  // Waits (bounded) for the target to exit after the initiator's BYE; its exit code (128 +
  // signal when a signal ended it), or -1 if it had to be killed. Everything it printed is
  // appended to *output when given.
  int Wait(absl::Duration timeout, std::string* output = nullptr) {
    if (pid_ <= 0) return -1;
    const absl::Time deadline = absl::Now() + timeout;
    int status = 0;
    pid_t r;
    // Its output is drained meanwhile (a full pipe would stop it).
    while ((r = waitpid(pid_, &status, WNOHANG)) == 0 && absl::Now() < deadline) {
      ReadSome(absl::Now() + absl::Milliseconds(10));
    }
    if (r != pid_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      pid_ = -1;
      ADD_FAILURE() << "kvwire-perf target did not exit within " << timeout << " and was killed";
      return -1;
    }
    pid_ = -1;
    while (ReadSome(absl::Now() + absl::Seconds(1))) {
    }
    if (output != nullptr) *output = output_;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  // Appends what the target printed to output_, waiting until `deadline` for something.
  // False at the end of its output (or on error) and at the deadline.
  bool ReadSome(absl::Time deadline) {
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    pollfd p{out_, POLLIN, 0};
    if (out_ < 0 || poll(&p, 1, static_cast<int>(ms)) <= 0) return false;
    char chunk[4096];
    const ssize_t n = read(out_, chunk, sizeof(chunk));
    if (n <= 0) return false;
    output_.append(chunk, static_cast<size_t>(n));
    return true;
  }

  pid_t pid_ = -1;
  int out_ = -1;
  int port_ = 0;
  std::string output_;
};

// Runs a kvwire-perf initiator to its end; its exit code (128 + signal when a signal ended
// it), its output (stdout and stderr) in *output.
inline int RunPerfInitiator(const std::vector<std::string>& args, std::string* output) {
  std::string cmd = absl::StrCat(KVWIRE_PERF_BIN, " ", absl::StrJoin(args, " "), " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_PERF_PERF_TARGET_H_
