#include "tests/rdma/control_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <poll.h>
#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "src/control/frame.h"
#include "src/util/log.h"

namespace kvwire::testing {
namespace {

constexpr uint32_t kMaxFrame = 64 << 20;

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Bounded socket I/O: a stuck peer fails the proxy instead of wedging the test.
void SetTimeouts(int fd) {
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

bool WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

absl::StatusOr<int> ConnectTo(const std::string& target) {
  const size_t colon = target.rfind(':');
  uint32_t port = 0;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(target.substr(colon + 1), &port) ||
      port > 65535 || inet_pton(AF_INET, target.substr(0, colon).c_str(), &sa.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("proxy target \"", target, "\" is not ip:port"));
  }
  sa.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    absl::Status s = Errno(absl::StrCat("connect to ", target));
    close(fd);
    return s;
  }
  SetTimeouts(fd);
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ControlProxy>> ControlProxy::Start(const std::string& target,
                                                                  Observer observer,
                                                                  absl::Duration accept_timeout) {
  std::unique_ptr<ControlProxy> proxy(new ControlProxy());
  proxy->observer_ = std::move(observer);
  proxy->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (proxy->listen_fd_ < 0) return Errno("socket");
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  if (bind(proxy->listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      listen(proxy->listen_fd_, 1) != 0 ||
      getsockname(proxy->listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    return Errno("proxy listen");
  }
  proxy->port_ = ntohs(sa.sin_port);
  proxy->thread_ =
      std::thread([p = proxy.get(), target, accept_timeout] { p->Run(target, accept_timeout); });
  return proxy;
}

ControlProxy::~ControlProxy() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  MutexLock lock(&client_mu_);
  for (int* fd : {&listen_fd_, &client_fd_, &target_fd_}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
}

std::string ControlProxy::address() const { return absl::StrCat("127.0.0.1:", port_); }

absl::Status ControlProxy::WriteToClient(const char* data, size_t size) {
  MutexLock lock(&client_mu_);
  if (!open_) return absl::FailedPreconditionError("proxy: no client connection");
  if (!WriteAll(client_fd_, data, size)) {
    open_ = false;
    return Errno("proxy: write to client");
  }
  return absl::OkStatus();
}

absl::Status ControlProxy::Inject(const pb::Envelope& envelope) {
  absl::StatusOr<std::string> frame = control::EncodeFrame(envelope, kMaxFrame);
  if (!frame.ok()) return frame.status();
  return WriteToClient(frame->data(), frame->size());
}

void ControlProxy::Run(const std::string& target, absl::Duration accept_timeout) {
  const absl::Time accept_deadline = absl::Now() + accept_timeout;
  int client = -1;
  while (!stop_ && client < 0) {
    if (absl::Now() > accept_deadline) {
      KVW_LOG(kError, "proxy") << "no client within the accept timeout";
      return;
    }
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 100) == 1) client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  }
  if (client < 0) return;
  SetTimeouts(client);
  absl::StatusOr<int> upstream = ConnectTo(target);
  {
    MutexLock lock(&client_mu_);
    client_fd_ = client;
    open_ = upstream.ok();
  }
  if (!upstream.ok()) {
    KVW_LOG(kError, "proxy") << "target unreachable" << Kv("error", upstream.status().message());
    return;
  }
  target_fd_ = *upstream;
  std::string pending;  // the target's bytes not yet forwarded: an incomplete frame
  char buf[64 << 10];
  while (!stop_) {
    pollfd p[2] = {{client, POLLIN, 0}, {target_fd_, POLLIN, 0}};
    if (poll(p, 2, 100) <= 0) continue;
    if (p[0].revents != 0) {
      const ssize_t n = recv(client, buf, sizeof(buf), 0);
      if (n <= 0 || !WriteAll(target_fd_, buf, static_cast<size_t>(n))) break;
    }
    if (p[1].revents != 0) {
      const ssize_t n = recv(target_fd_, buf, sizeof(buf), 0);
      if (n <= 0) break;
      pending.append(buf, static_cast<size_t>(n));
      // Whole frames only, so that an injected frame never lands inside one of the target's.
      while (pending.size() >= control::kFrameHeaderBytes) {
        uint32_t be = 0;
        std::memcpy(&be, pending.data(), sizeof(be));
        const size_t size = control::kFrameHeaderBytes + ntohl(be);
        if (pending.size() < size) break;
        pb::Envelope envelope;
        if (observer_ &&
            envelope.ParseFromArray(pending.data() + control::kFrameHeaderBytes,
                                    static_cast<int>(size - control::kFrameHeaderBytes))) {
          observer_(envelope);
        }
        if (!WriteToClient(pending.data(), size).ok()) {
          stop_ = true;
          break;
        }
        pending.erase(0, size);
      }
    }
  }
  MutexLock lock(&client_mu_);
  open_ = false;
  // Both ends see the connection end, as they would if either side had closed it.
  shutdown(client, SHUT_RDWR);
  shutdown(target_fd_, SHUT_RDWR);
}

}  // namespace kvwire::testing
