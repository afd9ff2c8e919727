// Child processes for the demo and the end-to-end tests: output to a log file, killed with
// the parent (PR_SET_PDEATHSIG) so that nothing is left behind even when the parent dies, and
// stopped (SIGTERM, then SIGKILL after a grace period) when the handle goes away. Servers
// report readiness through a "ready file" they write atomically once they listen.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_PROCESS_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dsv4::serve {

class Process {
 public:
  static absl::StatusOr<std::unique_ptr<Process>> Start(const std::string& path,
                                                        const std::vector<std::string>& args,
                                                        const std::string& log_path);
  Process() = default;
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  // True while the child has not exited.
  bool Running();
  // Sends `signal` and reaps the child (SIGKILL: at once; else SIGKILL after `grace`).
  void Stop(int signal, absl::Duration grace = absl::Seconds(10));
  // Waits for the child to exit by itself; its exit code, or DeadlineExceeded.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // Exit code once the child has been reaped (128 + signal when a signal ended it), else -1.
  int exit_code() const { return exit_code_; }
  // Empty while the child runs and when it ended cleanly: exit 0, or death by the SIGKILL
  // that Stop(SIGKILL) sent on purpose. Otherwise how it ended badly (a non-zero exit: a
  // sanitizer report, a leak or a failed check; a signal nobody sent through Stop; or having
  // to be killed after Stop's grace period), for tests that judge their servers' ends.
  std::string EndProblem() const { return end_problem_; }
  // The tail of the log (for test failure messages).
  std::string LogTail(size_t bytes = 4000) const;

 private:
  pid_t pid_ = -1;
  int exit_code_ = -1;
  int sent_signal_ = 0;
  std::string end_problem_;
  std::string log_path_;
  // Records how the reaped child ended (exit_code_, end_problem_).
  void Reaped(int status);
};

// Writes `j` to `path` atomically (temporary file + rename).
absl::Status WriteReadyFile(const std::string& path, const nlohmann::json& j);
// Waits until `path` exists and parses; fails early when `process` exits.
absl::StatusOr<nlohmann::json> WaitForReadyFile(const std::string& path, Process& process,
                                                absl::Duration timeout);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_PROCESS_H_
