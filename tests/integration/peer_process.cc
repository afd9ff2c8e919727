#include "tests/integration/peer_process.h"

#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvwire::testing {

absl::StatusOr<std::unique_ptr<PeerProcess>> PeerProcess::Start(
    const std::vector<std::string>& args, absl::Duration timeout) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::vector<std::string> argv_storage = {KVWIRE_TEST_PEER};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  auto peer = std::make_unique<PeerProcess>();
  peer->pid_ = pid;
  peer->stdin_fd_ = in[1];
  peer->stdout_fd_ = out[0];
  auto line = peer->ReadLine(timeout);
  if (!line.ok()) return line.status();
  if (line->rfind("READY ", 0) != 0) {
    return absl::InternalError(absl::StrCat("test peer said: ", *line));
  }
  for (absl::string_view field : absl::StrSplit(line->substr(6), ' ')) {
    std::vector<std::string> kv = absl::StrSplit(field, absl::MaxSplits('=', 1));
    if (kv.size() != 2) continue;
    if (kv[0] == "address") peer->address_ = kv[1];
    if (kv[0] == "name") peer->name_ = kv[1];
    if (kv[0] == "regions") {
      for (absl::string_view id : absl::StrSplit(kv[1], ',', absl::SkipEmpty())) {
        RegionId r = 0;
        if (absl::SimpleAtoi(id, &r)) peer->regions_.push_back(r);
      }
    }
  }
  return peer;
}

absl::Status PeerProcess::WriteLine(const std::string& line) {
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(stdin_fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return absl::UnavailableError(absl::StrCat("write to peer: ", std::strerror(errno)));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PeerProcess::ReadLine(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("test peer printed no line within ", absl::FormatDuration(timeout)));
    }
    pollfd p{stdout_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(ms)) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(stdout_fd_, chunk, sizeof(chunk));
    if (n <= 0) return absl::UnavailableError("test peer closed its stdout (exited?)");
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

void PeerProcess::Signal(int sig) {
  if (pid_ <= 0) return;
  if (sig != SIGSTOP && sig != SIGCONT && sig != 0) expected_signal_ = sig;
  kill(pid_, sig);
}

absl::Status PeerProcess::Freeze(absl::Duration timeout) {
  Signal(SIGSTOP);
  const absl::Time deadline = absl::Now() + timeout;
  const std::string tasks = absl::StrCat("/proc/", pid_, "/task");
  while (absl::Now() < deadline) {
    bool all_stopped = true;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      // Field 3, after the parenthesised name: T = stopped.
      const size_t close = line.rfind(')');
      if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'T') {
        all_stopped = false;
        break;
      }
    }
    if (!ec && all_stopped) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(5));
  }
  return absl::DeadlineExceededError(absl::StrCat("peer ", pid_, " did not stop"));
}

void PeerProcess::Stop(absl::Duration grace) {
  if (pid_ <= 0) return;
  if (stdin_fd_ >= 0) {
    close(stdin_fd_);
    stdin_fd_ = -1;
  }
  kill(pid_, SIGCONT);
  const absl::Time deadline = absl::Now() + grace;
  int status = 0;
  bool had_to_kill = false;
  while (waitpid(pid_, &status, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      had_to_kill = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (had_to_kill) {
    end_problem_ = absl::StrCat("did not exit within ", absl::FormatDuration(grace),
                                " of its stdin closing and was killed");
  } else if (WIFSIGNALED(status) && WTERMSIG(status) != expected_signal_) {
    end_problem_ = absl::StrCat("died of signal ", WTERMSIG(status), " (",
                                strsignal(WTERMSIG(status)), ") that the test did not send");
  } else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
    end_problem_ = absl::StrCat("exited with status ", WEXITSTATUS(status),
                                " (a sanitizer report or a failed check; see its stderr above)");
  }
  if (!end_problem_.empty()) {
    ADD_FAILURE() << "test peer " << pid_ << " (" << name_ << ") " << end_problem_;
  }
  pid_ = -1;
}

PeerProcess::~PeerProcess() {
  Stop();
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

}  // namespace kvwire::testing
