// Blocking TCP sockets for the tcp transport: ownership that is safe to wake from any
// thread, gather/scatter I/O helpers, socket options, endpoint parsing, and a dial with a
// deadline (Boost.Asio).
#ifndef KVWIRE_TRANSPORT_TCP_TCP_SOCKET_H_
#define KVWIRE_TRANSPORT_TCP_TCP_SOCKET_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"

namespace kvwire::transport {

// A connected TCP socket in blocking mode. Any thread may Shutdown() it to wake the threads
// blocked on it; the descriptor is closed only by Close() or the destructor, and Shutdown()
// after Close() does nothing, so a concurrent shutdown(2) never hits a reused descriptor.
class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { Close(); }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // The descriptor, for the threads that own the connection (valid until Close()).
  int fd() const { return fd_; }
  // shutdown(SHUT_RDWR): every blocked send/recv on the socket returns. Thread-safe.
  void Shutdown();
  // shutdown(SHUT_WR) only: the peer sees end of stream after the bytes already sent.
  void ShutdownWrite();
  // Call only when no thread uses fd() any more.
  void Close();

 private:
  const int fd_;
  Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// "Connection reset by peer", "connection closed by peer", ... for error messages.
std::string ErrnoText(int err);

// O_NONBLOCK on or off.
absl::Status SetNonBlocking(int fd, bool on);

// One sendmsg(2) of iov[0..count) that never blocks: the bytes sent (0 when the socket buffer
// is full). Errors: Unavailable with the errno text.
absl::StatusOr<size_t> SendSome(int fd, iovec* iov, size_t count);

// Sends every byte described by iov[0..count). The array is consumed: entries are advanced in
// place across partial sends. On a non-blocking socket it waits (poll) for room; on a
// blocking one with SO_SNDTIMEO, the timeout is DeadlineExceeded. Errors: Unavailable with
// the errno text.
absl::Status SendAll(int fd, iovec* iov, size_t count);
absl::Status SendAll(int fd, const void* data, size_t length);

enum class RecvMode {
  kSome,         // block until at least one byte is there
  kNonBlocking,  // return 0 when nothing is there
  kWaitAll,      // block until all of iov is filled (MSG_WAITALL; fewer wake-ups), or error
};
// One recvmsg(2) into iov[0..count) (kSome and kWaitAll wait with poll on a non-blocking
// socket). Returns the bytes read (> 0; possibly fewer than asked
// even with kWaitAll, e.g. on a signal), or 0 with kNonBlocking when nothing is there yet.
// Errors: Unavailable "connection closed by peer" at end of stream or the errno text;
// DeadlineExceeded when a receive timeout (SetIoTimeout) expired.
absl::StatusOr<size_t> RecvSome(int fd, iovec* iov, size_t count, RecvMode mode);
// Receives exactly `length` bytes.
absl::Status RecvExact(int fd, void* data, size_t length);

// TCP_NODELAY, and SO_SNDBUF/SO_RCVBUF when buffer_bytes > 0 (set before connect/listen so
// that the window scale is negotiated for them).
absl::Status ConfigureSocket(int fd, int buffer_bytes);
// SO_RCVTIMEO and SO_SNDTIMEO; a zero or infinite duration means none.
absl::Status SetIoTimeout(int fd, absl::Duration timeout);

// "host:port" or "[v6host]:port".
absl::Status ParseEndpoint(const std::string& endpoint, std::string* host, uint16_t* port);
std::string FormatEndpoint(const std::string& host, uint16_t port);

// Connects to `endpoint` before `deadline`, with ConfigureSocket(buffer_bytes) applied first.
// Errors name the endpoint: DeadlineExceeded, Unavailable (refused, unreachable), or
// InvalidArgument (not host:port, unresolvable).
absl::StatusOr<std::unique_ptr<Socket>> Dial(const std::string& endpoint, absl::Time deadline,
                                             int buffer_bytes);

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_SOCKET_H_
