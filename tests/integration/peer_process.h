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
  void Signal(int sig);
  // SIGSTOP, then waits until every thread of the peer is stopped (kill() only queues the
  // signal; a thread inside a system call finishes it first).
  absl::Status Freeze(absl::Duration timeout = absl::Seconds(10));
  // Closes stdin (the peer exits) and reaps it, SIGKILL after `grace`.
  void Stop(absl::Duration grace = absl::Seconds(10));

 private:
  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;
  std::string address_, name_;
  std::vector<RegionId> regions_;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_INTEGRATION_PEER_PROCESS_H_
