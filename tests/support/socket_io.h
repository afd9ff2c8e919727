// Blocking socket I/O for tests, every wait bounded by a deadline: a test that talks to a
// process (a forked target, a hostile peer) over a socket must fail, not hang, when the other
// side stops answering.
#ifndef KVWIRE_TESTS_SUPPORT_SOCKET_IO_H_
#define KVWIRE_TESTS_SUPPORT_SOCKET_IO_H_

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <poll.h>
#include <string>
#include <unistd.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvwire::testing {

// True once `fd` is ready for `events` (POLLIN, POLLOUT); false at `deadline` or on an error.
inline bool WaitReady(int fd, short events, absl::Time deadline) {
  while (true) {
    pollfd entry{fd, events, 0};
    const int ms =
        static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
    const int n = poll(&entry, 1, ms);
    if (n > 0) return true;
    if (n == 0 || errno != EINTR) return false;
  }
}

// Sends all `size` bytes (no SIGPIPE); false if the peer is gone or `deadline` passes.
inline bool WriteAll(int fd, const void* data, size_t size, absl::Time deadline) {
  const char* at = static_cast<const char*>(data);
  while (size > 0) {
    if (!WaitReady(fd, POLLOUT, deadline)) return false;
    const ssize_t n = send(fd, at, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    at += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Reads exactly `size` bytes; false at EOF, on an error or once `deadline` passes.
inline bool ReadAll(int fd, void* data, size_t size, absl::Time deadline) {
  char* at = static_cast<char*>(data);
  while (size > 0) {
    if (!WaitReady(fd, POLLIN, deadline)) return false;
    const ssize_t n = read(fd, at, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    at += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// A string as its 64-bit length (host order: both ends are this machine) and its bytes.
inline bool WriteString(int fd, const std::string& s, absl::Time deadline) {
  const uint64_t size = s.size();
  return WriteAll(fd, &size, sizeof(size), deadline) && WriteAll(fd, s.data(), size, deadline);
}

// WriteString's string; false if its length is over `max_bytes` (a broken or hostile writer).
inline bool ReadString(int fd, std::string* s, absl::Time deadline,
                       uint64_t max_bytes = uint64_t{64} << 20) {
  uint64_t size = 0;
  if (!ReadAll(fd, &size, sizeof(size), deadline) || size > max_bytes) return false;
  s->resize(size);
  return ReadAll(fd, s->data(), size, deadline);
}

// True once the other side has closed `fd` (EOF or reset), false if it is still open at
// `deadline`. Bytes that arrive meanwhile are read and dropped.
inline bool ClosedBy(int fd, absl::Time deadline) {
  while (true) {
    if (!WaitReady(fd, POLLIN, deadline)) return false;
    char byte;
    const ssize_t got = recv(fd, &byte, 1, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_SOCKET_IO_H_
