#include "transport/tcp/tcp_socket.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvwire::transport {
namespace asio = boost::asio;

void Socket::Shutdown() {
  MutexLock lock(&mu_);
  if (!closed_) ::shutdown(fd_, SHUT_RDWR);
}

void Socket::ShutdownWrite() {
  MutexLock lock(&mu_);
  if (!closed_) ::shutdown(fd_, SHUT_WR);
}

void Socket::Close() {
  MutexLock lock(&mu_);
  if (closed_) return;
  closed_ = true;
  if (fd_ >= 0) ::close(fd_);
}

namespace {

bool IsNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && (flags & O_NONBLOCK) != 0;
}

bool WaitFor(int fd, short events) {
  pollfd entry{fd, events, 0};
  while (true) {
    const int n = ::poll(&entry, 1, -1);
    if (n >= 0) return true;  // ready, or an error/hang-up the next call reports
    if (errno != EINTR) return false;
  }
}

}  // namespace

absl::Status SetNonBlocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK)) != 0) {
    return absl::InternalError(absl::StrCat("fcntl(O_NONBLOCK): ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> SendSome(int fd, iovec* iov, size_t count) {
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = std::min<size_t>(count, IOV_MAX);
  while (true) {
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return static_cast<size_t>(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return absl::UnavailableError(ErrnoText(errno));
  }
}

std::string ErrnoText(int err) {
  if (err == 0) return "connection closed by peer";
  char buf[128];
  // GNU strerror_r returns the message (which may or may not be `buf`).
  return strerror_r(err, buf, sizeof(buf));
}

absl::Status SendAll(int fd, iovec* iov, size_t count) {
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = std::min<size_t>(count, IOV_MAX);
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // A non-blocking socket (an I/O-pool connection on a path that blocks its thread, e.g.
        // device staging): wait until it drains. Shutdown() of the socket ends the wait.
        if (IsNonBlocking(fd) && WaitFor(fd, POLLOUT)) continue;
        return absl::DeadlineExceededError("timed out");
      }
      return absl::UnavailableError(ErrnoText(errno));
    }
    size_t sent = static_cast<size_t>(n);
    while (count > 0 && sent >= iov->iov_len) {
      sent -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + sent;
      iov->iov_len -= sent;
    }
  }
  return absl::OkStatus();
}

absl::Status SendAll(int fd, const void* data, size_t length) {
  iovec iov{const_cast<void*>(data), length};
  return SendAll(fd, &iov, 1);
}

absl::StatusOr<size_t> RecvSome(int fd, iovec* iov, size_t count, RecvMode mode) {
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = std::min<size_t>(count, IOV_MAX);
  const int flags = mode == RecvMode::kNonBlocking ? MSG_DONTWAIT
                    : mode == RecvMode::kWaitAll   ? MSG_WAITALL
                                                   : 0;
  while (true) {
    const ssize_t n = ::recvmsg(fd, &msg, flags);
    if (n > 0) return static_cast<size_t>(n);
    if (n == 0) return absl::UnavailableError(ErrnoText(0));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (mode == RecvMode::kNonBlocking) return 0;
      // See SendAll: a non-blocking socket on a path that blocks its thread.
      if (IsNonBlocking(fd) && WaitFor(fd, POLLIN)) continue;
      return absl::DeadlineExceededError("timed out");
    }
    return absl::UnavailableError(ErrnoText(errno));
  }
}

absl::Status RecvExact(int fd, void* data, size_t length) {
  auto* p = static_cast<char*>(data);
  while (length > 0) {
    iovec iov{p, length};
    absl::StatusOr<size_t> n = RecvSome(fd, &iov, 1, RecvMode::kWaitAll);
    if (!n.ok()) return n.status();
    p += *n;
    length -= *n;
  }
  return absl::OkStatus();
}

absl::Status ConfigureSocket(int fd, int buffer_bytes) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return absl::InternalError(absl::StrCat("setsockopt(TCP_NODELAY): ", ErrnoText(errno)));
  }
  if (buffer_bytes > 0) {
    // The kernel caps these at net.core.{w,r}mem_max; that is fine, not an error.
    if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes)) != 0 ||
        ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes)) != 0) {
      return absl::InternalError(
          absl::StrCat("setsockopt(SO_SNDBUF/SO_RCVBUF ", buffer_bytes, "): ", ErrnoText(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status SetIoTimeout(int fd, absl::Duration timeout) {
  timeval tv{};
  if (timeout > absl::ZeroDuration() && timeout != absl::InfiniteDuration()) {
    // A timeval of zero means "no timeout": round tiny positive values up to 1 us.
    tv = absl::ToTimeval(std::max(timeout, absl::Microseconds(1)));
  }
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return absl::InternalError(absl::StrCat("setsockopt(SO_RCVTIMEO): ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

absl::Status ParseEndpoint(const std::string& endpoint, std::string* host, uint16_t* port) {
  const size_t colon = endpoint.rfind(':');
  uint32_t value = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(endpoint.substr(colon + 1), &value) || value == 0 || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp endpoint '", endpoint, "' is not host:port"));
  }
  *host = endpoint.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  *port = static_cast<uint16_t>(value);
  return absl::OkStatus();
}

std::string FormatEndpoint(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<std::unique_ptr<Socket>> Dial(const std::string& endpoint, absl::Time deadline,
                                             int buffer_bytes) {
  std::string host;
  uint16_t port = 0;
  if (absl::Status s = ParseEndpoint(endpoint, &host, &port); !s.ok()) return s;

  asio::io_context io;
  boost::system::error_code ec;
  asio::ip::tcp::resolver resolver(io);
  const auto results =
      resolver.resolve(host, std::to_string(port), asio::ip::resolver_base::numeric_service, ec);
  if (ec || results.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp endpoint ", endpoint, ": cannot resolve host: ", ec.message()));
  }

  std::string last_error = "no address";
  for (const auto& entry : results) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    asio::ip::tcp::socket socket(io);
    socket.open(entry.endpoint().protocol(), ec);
    if (ec) {
      last_error = ec.message();
      continue;
    }
    if (absl::Status s = ConfigureSocket(socket.native_handle(), buffer_bytes); !s.ok()) {
      return absl::InternalError(absl::StrCat("tcp connect to ", endpoint, ": ", s.message()));
    }
    bool finished = false;
    boost::system::error_code connect_ec;
    socket.async_connect(entry.endpoint(), [&](const boost::system::error_code& e) {
      finished = true;
      connect_ec = e;
    });
    io.restart();
    if (deadline == absl::InfiniteFuture()) {
      io.run();
    } else {
      io.run_for(std::chrono::nanoseconds(absl::ToInt64Nanoseconds(left)));
    }
    if (!finished) {
      // Deadline: cancel the attempt and let its handler run before `socket` goes away.
      socket.close(ec);
      io.restart();
      io.run();
      return absl::DeadlineExceededError(
          absl::StrCat("tcp connect to ", endpoint, " timed out (deadline passed)"));
    }
    if (connect_ec) {
      last_error = connect_ec.message();
      continue;
    }
    // The transport does blocking I/O on the descriptor; asio put it in non-blocking mode.
    socket.native_non_blocking(false, ec);
    if (ec)
      return absl::InternalError(absl::StrCat("tcp connect to ", endpoint, ": ", ec.message()));
    const int fd = socket.release(ec);
    if (ec)
      return absl::InternalError(absl::StrCat("tcp connect to ", endpoint, ": ", ec.message()));
    return std::make_unique<Socket>(fd);
  }
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("tcp connect to ", endpoint, " timed out (deadline passed)"));
  }
  return absl::UnavailableError(absl::StrCat("tcp connect to ", endpoint, " failed: ", last_error));
}

}  // namespace kvwire::transport
