// The tcp readiness backend a test binary runs its transports on: KVWIRE_TCP_IO_BACKEND (ctest
// runs the tcp test binaries a second time with io_uring: the same tests over the other
// backend), and the gtest environment that skips every test, saying why, where io_uring was
// asked for and the kernel (or a seccomp filter) refuses it. ctest matches the skip's text.
#ifndef KVWIRE_TESTS_SUPPORT_TCP_BACKEND_H_
#define KVWIRE_TESTS_SUPPORT_TCP_BACKEND_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

#include "transport/tcp/tcp_io_pool.h"

namespace kvwire::testing {

inline std::string TcpTestBackend() {
  const char* env = std::getenv("KVWIRE_TCP_IO_BACKEND");
  return env != nullptr && *env != '\0' ? env : "epoll";
}

// Register once per binary: ::testing::AddGlobalTestEnvironment(new TcpBackendEnvironment).
class TcpBackendEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    std::printf("tcp I/O backend: %s\n", TcpTestBackend().c_str());
    if (TcpTestBackend() != "io_uring") return;
    if (absl::Status s = transport::IoUringAvailable(); !s.ok()) {
      GTEST_SKIP() << "io_uring is not available here: " << s;
    }
  }
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_TCP_BACKEND_H_
