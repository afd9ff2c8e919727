#include "examples/dsv4/serve/process.h"

#include <sys/prctl.h>
#include <sys/wait.h>

#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace dsv4::serve {

absl::StatusOr<std::unique_ptr<Process>> Process::Start(const std::string& path,
                                                        const std::vector<std::string>& args,
                                                        const std::string& log_path) {
  std::vector<std::string> all = {path};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) return absl::InternalError(absl::StrCat("cannot open log ", log_path));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(log);
    return absl::InternalError("fork failed");
  }
  if (pid == 0) {
    // Die with the parent, whatever kills it.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    dup2(log, STDOUT_FILENO);
    dup2(log, STDERR_FILENO);
    execv(path.c_str(), argv.data());
    _exit(127);
  }
  close(log);
  auto p = std::make_unique<Process>();
  p->pid_ = pid;
  p->log_path_ = log_path;
  return p;
}

Process::~Process() { Stop(SIGTERM); }

bool Process::Running() {
  if (pid_ <= 0) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    Reaped(status);
    return false;
  }
  return r == 0;
}

void Process::Reaped(int status) {
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (WIFSIGNALED(status) && !(WTERMSIG(status) == SIGKILL && sent_signal_ == SIGKILL)) {
    end_problem_ =
        absl::StrCat("died of signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  } else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
    end_problem_ = absl::StrCat("exited with status ", WEXITSTATUS(status),
                                " (a sanitizer report, a leak or a failed check)");
  }
  pid_ = -1;
}

absl::StatusOr<int> Process::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (Running()) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("process ", pid_, " still running"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return exit_code_;
}

void Process::Stop(int signal, absl::Duration grace) {
  if (!Running()) return;
  sent_signal_ = signal;
  kill(pid_, signal);
  if (signal != SIGKILL && Wait(grace).ok()) return;
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    const bool hung = sent_signal_ != SIGKILL;
    sent_signal_ = SIGKILL;
    Reaped(status);
    if (hung) {
      end_problem_ = absl::StrCat("did not exit within ", absl::FormatDuration(grace),
                                  " of signal ", signal, " and was killed");
    }
  }
}

std::string Process::LogTail(size_t bytes) const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > bytes ? s.substr(s.size() - bytes) : s;
}

absl::Status WriteReadyFile(const std::string& path, const nlohmann::json& j) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp);
    out << j.dump() << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::json> WaitForReadyFile(const std::string& path, Process& process,
                                                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::ifstream in(path);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
      if (!j.is_discarded()) return j;
    }
    if (!process.Running()) {
      return absl::FailedPreconditionError(
          absl::StrCat("process exited before it was ready; log:\n", process.LogTail()));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no ready file ", path, " in time; log:\n", process.LogTail()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace dsv4::serve
