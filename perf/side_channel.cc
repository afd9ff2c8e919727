#include "perf/side_channel.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <netdb.h>
#include <poll.h>
#include <unistd.h>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvwire::perf {
namespace {

// Side-channel lines are short (the longest is HELLO with the settings): a longer one is an
// error, not a reason to buffer more.
constexpr size_t kMaxLineBytes = 64 << 10;
// A peer that stops reading cannot hold a send for longer than this.
constexpr int kSendTimeoutSeconds = 60;

// TCP_NODELAY (lines are small and answered) and the send timeout.
void ConfigureLineSocket(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  timeval tv{};
  tv.tv_sec = kSendTimeoutSeconds;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

int RemainingMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

// Waits for `events` on fd until the deadline; false on timeout.
absl::StatusOr<bool> WaitFd(int fd, short events, absl::Time deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, RemainingMs(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return Errno("poll");
  }
}

}  // namespace

LineSocket::LineSocket(LineSocket&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), buffer_(std::move(other.buffer_)) {}

LineSocket& LineSocket::operator=(LineSocket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

LineSocket::~LineSocket() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<LineSocket> LineSocket::Dial(const std::string& host, int port,
                                            absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::NotFoundError(absl::StrCat("resolving ", host, ": ", gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  absl::Status last = absl::UnavailableError("no address");
  while (true) {
    for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
      LineSocket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (s.fd_ < 0) return Errno("socket");
      if (::connect(s.fd_, a->ai_addr, a->ai_addrlen) == 0) {
        ConfigureLineSocket(s.fd_);
        return s;
      }
      last = Errno(absl::StrCat("connecting to the target at ", host, ":", port));
    }
    if (absl::Now() + absl::Milliseconds(100) > deadline) return last;
    absl::SleepFor(absl::Milliseconds(100));
  }
}

absl::Status LineSocket::SendLine(const std::string& line) {
  std::string data = line + "\n";
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::DeadlineExceededError(absl::StrCat(
            "side channel send: the peer took nothing for ", kSendTimeoutSeconds, " s"));
      }
      return Errno("side channel send");
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LineSocket::ReadLine(absl::Duration timeout) {
  const absl::Time deadline =
      timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  while (true) {
    if (size_t nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    if (buffer_.size() > kMaxLineBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("side channel: line longer than ", kMaxLineBytes, " bytes"));
    }
    absl::StatusOr<bool> ready = WaitFd(
        fd_, POLLIN, deadline == absl::InfiniteFuture() ? absl::Now() + absl::Hours(24) : deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("side channel: no answer from the peer");
    char chunk[4096];
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return Errno("side channel receive");
    }
    if (n == 0) return absl::UnavailableError("side channel: the peer closed the connection");
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

absl::StatusOr<LineListener> LineListener::Listen(const std::string& bind, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (int rc = ::getaddrinfo(bind.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("resolving ", bind, ": ", gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  LineListener l;
  l.fd_ = ::socket(list->ai_family, list->ai_socktype | SOCK_CLOEXEC, list->ai_protocol);
  if (l.fd_ < 0) return Errno("socket");
  const int one = 1;
  ::setsockopt(l.fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(l.fd_, list->ai_addr, list->ai_addrlen) != 0) {
    return Errno(absl::StrCat("side channel: binding ", bind, ":", port));
  }
  if (::listen(l.fd_, 4) != 0) return Errno("listen");
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(l.fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return Errno("getsockname");
  }
  l.port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return l;
}

LineListener::LineListener(LineListener&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), port_(other.port_) {}

LineListener& LineListener::operator=(LineListener&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    port_ = other.port_;
  }
  return *this;
}

LineListener::~LineListener() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<LineSocket> LineListener::Accept(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::StatusOr<bool> ready = WaitFd(fd_, POLLIN, deadline);
  if (!ready.ok()) return ready.status();
  if (!*ready) return absl::DeadlineExceededError("no initiator connected");
  const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return Errno("accept");
  ConfigureLineSocket(fd);
  return LineSocket(fd);
}

}  // namespace kvwire::perf
