// Starts kvwire_test_peer as a child process and talks to it through its stdin/stdout.
#ifndef KVWIRE_TESTS_INTEGRATION_PEER_PROCESS_H_
#define KVWIRE_TESTS_INTEGRATION_PEER_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"

namespace kvwire::testing {

class PeerProcess {
 public:
  // Starts the peer with `args` ("--key=value") and waits for its READY line.
  static absl::StatusOr<std::unique_ptr<PeerProcess>> Start(
      const std::vector<std::string>& args, absl::Duration timeout = absl::Seconds(30));
  PeerProcess() = default;  // use Start
  ~PeerProcess();

  const std::string& address() const { return address_; }
  const std::string& name() const { return name_; }
  const std::vector<RegionId>& regions() const { return regions_; }
  pid_t pid() const { return pid_; }

  // Writes `line` and a newline to the peer's stdin.
  absl::Status WriteLine(const std::string& line);
  // Next stdout line, or DeadlineExceeded.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  // Sends `sig`. A signal other than SIGSTOP/SIGCONT sent here is the test's own doing: the
  // peer dying of it is not a failure.
  void Signal(int sig);
  // SIGSTOP, then waits until every thread of the peer is stopped (kill() only queues the
  // signal; a thread inside a system call finishes it first).
  absl::Status Freeze(absl::Duration timeout = absl::Seconds(10));
  // Closes stdin (the peer exits) and reaps it, SIGKILL after `grace`. The peer's end is
  // part of the test: a non-zero exit (a sanitizer report or leak under ASan/UBSan/TSan, a
  // CHECK), death by a signal the test did not send through Signal(), or having to be killed
  // is reported as a failure of the running test (ADD_FAILURE). Idempotent.
  void Stop(absl::Duration grace = absl::Seconds(10));
  // What Stop() judged, for tests of this class: empty when the peer ended cleanly.
  const std::string& end_problem() const { return end_problem_; }

 private:
  pid_t pid_ = -1;
  int expected_signal_ = 0;
  std::string end_problem_;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;
  std::string address_, name_;
  std::vector<RegionId> regions_;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_INTEGRATION_PEER_PROCESS_H_
