// A child process the test talks to through its stdin and stdout, one line at a time.
#ifndef KVWIRE_TESTS_CONNECTOR_CHILD_H_
#define KVWIRE_TESTS_CONNECTOR_CHILD_H_

#include <sys/wait.h>

#include <cstring>
#include <fcntl.h>
#include <memory>
#include <poll.h>
#include <signal.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

#include "tests/support/child_end.h"

namespace kvwire::testing {

class Child {
 public:
  static absl::StatusOr<std::unique_ptr<Child>> Start(const std::string& path,
                                                      const std::vector<std::string>& args) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
      return absl::InternalError("pipe2 failed");
    }
    std::vector<std::string> all = {path};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      dup2(in[0], STDIN_FILENO);
      dup2(out[1], STDOUT_FILENO);
      execv(path.c_str(), argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    auto c = std::make_unique<Child>();
    c->pid_ = pid;
    c->stdin_ = in[1];
    c->stdout_ = out[0];
    return c;
  }

  Child() = default;
  ~Child() { Stop(); }

  pid_t pid() const { return pid_; }

  void Send(const std::string& line) {
    const std::string l = line + "\n";
    if (stdin_ >= 0) (void)!write(stdin_, l.data(), l.size());
  }

  // The next line starting with `prefix` (other lines are skipped), or DeadlineExceeded.
  absl::StatusOr<std::string> Expect(const std::string& prefix,
                                     absl::Duration timeout = absl::Seconds(60)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      size_t nl;
      while ((nl = buffer_.find('\n')) != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        if (line.rfind(prefix, 0) == 0) return line;
        seen_.push_back(line);
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(absl::StrCat("no '", prefix, "' line from child"));
      }
      pollfd p{stdout_, POLLIN, 0};
      const int ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left), 200));
      if (poll(&p, 1, ms) <= 0) continue;
      char chunk[65536];
      const ssize_t n = read(stdout_, chunk, sizeof(chunk));
      if (n <= 0) return absl::UnavailableError("child closed its stdout");
      buffer_.append(chunk, n);
    }
  }

  // Kills the child on purpose (a test of peer death): the kill is the test's own, but a
  // child that had already ended by itself (a sanitizer report, a crash) is judged as in Stop.
  void Kill() {
    if (pid_ > 0) {
      end_problem_ = KillAndJudge(pid_);
      if (!end_problem_.empty()) ADD_FAILURE() << "child " << pid_ << " " << end_problem_;
      pid_ = -1;
    }
  }

  // Closes stdin and reaps the child, SIGKILL after `grace`. The child's end is part of the
  // test: a non-zero exit (a sanitizer report or leak, a failed check), death by a signal,
  // or having to be killed is reported as a failure of the running test. Idempotent.
  void Stop(absl::Duration grace = absl::Seconds(20)) {
    if (stdin_ >= 0) close(stdin_);
    stdin_ = -1;
    if (pid_ > 0) {
      const absl::Time deadline = absl::Now() + grace;
      int status = 0;
      bool reaped = false;
      while (absl::Now() < deadline) {
        if (waitpid(pid_, &status, WNOHANG) == pid_) {
          reaped = true;
          break;
        }
        absl::SleepFor(absl::Milliseconds(20));
      }
      if (!reaped) {
        end_problem_ = absl::StrCat("did not exit within ", absl::FormatDuration(grace),
                                    " of its stdin closing and was killed");
      } else if (WIFSIGNALED(status)) {
        end_problem_ = absl::StrCat("died of signal ", WTERMSIG(status), " (",
                                    strsignal(WTERMSIG(status)), ")");
      } else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
        end_problem_ = absl::StrCat("exited with status ", WEXITSTATUS(status),
                                    " (a sanitizer report or a failed check; see its stderr)");
      }
      if (!end_problem_.empty()) ADD_FAILURE() << "child " << pid_ << " " << end_problem_;
      if (reaped) {
        pid_ = -1;
      } else {
        Kill();
      }
    }
    if (stdout_ >= 0) close(stdout_);
    stdout_ = -1;
  }

  // What Stop() judged: empty when the child ended cleanly.
  const std::string& end_problem() const { return end_problem_; }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1, stdout_ = -1;
  std::string buffer_;
  std::vector<std::string> seen_;
  std::string end_problem_;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_CONNECTOR_CHILD_H_
