#include "transport/rdma/setup_socket.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/log.h"

namespace kvwire::transport::rdma {
namespace {

constexpr uint32_t kMaxMessage = 1 << 20;

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

int MsLeft(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 60000));
}

absl::Status WaitFd(int fd, short events, absl::Time deadline, const char* what) {
  while (true) {
    pollfd p{fd, events, 0};
    const int ms = MsLeft(deadline);
    const int n = poll(&p, 1, ms);
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(absl::StrCat(what, ": poll: ", std::strerror(errno)));
    if (ms == 0 || absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    }
  }
}

absl::Status WriteAll(int fd, const std::string& data, absl::Time deadline) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (absl::Status s = WaitFd(fd, POLLOUT, deadline, "send"); !s.ok()) return s;
    } else {
      return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, char* data, size_t size, absl::Time deadline) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = recv(fd, data + done, size - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n == 0) {
      return absl::UnavailableError("connection closed by the other side");
    } else if (errno == EAGAIN || errno == EINTR) {
      if (absl::Status s = WaitFd(fd, POLLIN, deadline, "recv"); !s.ok()) return s;
    } else {
      return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status SendFrame(int fd, const std::string& body, absl::Time deadline) {
  const uint32_t len = htonl(static_cast<uint32_t>(body.size()));
  std::string frame(reinterpret_cast<const char*>(&len), 4);
  frame += body;
  return WriteAll(fd, frame, deadline);
}

absl::StatusOr<std::string> ReadFrame(int fd, absl::Time deadline) {
  uint32_t len = 0;
  if (absl::Status s = ReadAll(fd, reinterpret_cast<char*>(&len), 4, deadline); !s.ok()) return s;
  len = ntohl(len);
  if (len > kMaxMessage) {
    return absl::InvalidArgumentError(absl::StrCat("setup message of ", len, " bytes refused"));
  }
  std::string body(len, '\0');
  if (absl::Status s = ReadAll(fd, body.data(), len, deadline); !s.ok()) return s;
  return body;
}

}  // namespace

absl::Status SetupCall(const std::string& host, uint16_t port,
                       const google::protobuf::MessageLite& request,
                       google::protobuf::MessageLite* reply, absl::Time deadline) {
  const std::string where = absl::StrCat("rdma setup ", host, ":", port);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not an IPv4 address"));
  }
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0)
    return absl::InternalError(absl::StrCat(where, ": socket: ", std::strerror(errno)));
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) {
      return absl::UnavailableError(absl::StrCat(where, ": connect: ", std::strerror(errno)));
    }
    if (absl::Status s = WaitFd(fd.get(), POLLOUT, deadline, "connect"); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      return absl::UnavailableError(absl::StrCat(where, ": connect: ", std::strerror(err)));
    }
  }
  absl::Status s = SendFrame(fd.get(), request.SerializeAsString(), deadline);
  if (s.ok()) {
    auto body = ReadFrame(fd.get(), deadline);
    if (!body.ok()) {
      s = body.status();
    } else if (!reply->ParseFromString(*body)) {
      s = absl::InvalidArgumentError("malformed reply");
    }
  }
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SetupServer>> SetupServer::Listen(const std::string& host,
                                                                 Handler handler) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("rdma setup socket: \"", host, "\" is not an IPv4 address"));
  }
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0 || bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd.get(), 64) != 0) {
    return absl::UnavailableError(
        absl::StrCat("rdma setup socket on ", host, ": ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  Fd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (wake.get() < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  auto server = std::make_unique<SetupServer>();
  server->listen_fd_ = fd.release();
  server->wake_fd_ = wake.release();
  server->port_ = ntohs(addr.sin_port);
  server->handler_ = std::move(handler);
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

void SetupServer::Run() {
  while (true) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) return;
    if (p[1].revents != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    Fd conn(accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (conn.get() < 0) continue;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    auto request = ReadFrame(conn.get(), deadline);
    if (!request.ok()) {
      KVW_LOG(kWarning, "rdma") << "setup request dropped"
                                << Kv("error", request.status().message());
      continue;
    }
    const std::string reply = handler_(*request);
    (void)SendFrame(conn.get(), reply, deadline);
  }
}

void SetupServer::Stop() {
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  listen_fd_ = wake_fd_ = -1;
}

SetupServer::~SetupServer() { Stop(); }

}  // namespace kvwire::transport::rdma
