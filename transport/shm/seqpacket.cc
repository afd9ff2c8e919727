#include "transport/shm/seqpacket.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <poll.h>
#include <vector>

#include "absl/strings/str_cat.h"

#include "transport/shm/errno_text.h"

namespace kvwire::transport::shm {
namespace {

absl::StatusOr<socklen_t> MakeAddress(const std::string& name, sockaddr_un* address) {
  if (name.empty() || name.size() > kMaxSocketNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "abstract socket name of ", name.size(), " bytes (1..", kMaxSocketNameBytes, " allowed)"));
  }
  std::memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  // sun_path[0] = '\0' selects the abstract namespace; the name is the bytes that follow.
  std::memcpy(address->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

absl::StatusOr<UniqueFd> NewSocket() {
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "socket(AF_UNIX)");
  }
  return fd;
}

int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  // Rounded up, so that a wait never ends before the deadline and spins.
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(left + absl::Milliseconds(1) - absl::Nanoseconds(1)), 1 << 30));
}

}  // namespace

absl::StatusOr<bool> WaitFor(int socket, short events, absl::Time deadline) {
  while (true) {
    pollfd entry{socket, events, 0};
    const int n = ::poll(&entry, 1, PollTimeoutMs(deadline));
    if (n > 0) return true;  // ready, or an error/hang-up the next call will report
    if (n == 0) {
      if (absl::Now() >= deadline) return false;
      continue;
    }
    if (errno != EINTR) return ErrnoStatus(absl::StatusCode::kInternal, errno, "poll");
  }
}

absl::StatusOr<UniqueFd> ListenSeqpacket(const std::string& name, int backlog) {
  sockaddr_un address;
  absl::StatusOr<socklen_t> length = MakeAddress(name, &address);
  if (!length.ok()) return length.status();
  absl::StatusOr<UniqueFd> fd = NewSocket();
  if (!fd.ok()) return fd.status();
  if (::bind(fd->get(), reinterpret_cast<const sockaddr*>(&address), *length) != 0) {
    return ErrnoStatus(absl::StatusCode::kUnavailable, errno,
                       absl::StrCat("bind of abstract socket @", name));
  }
  if (::listen(fd->get(), backlog) != 0) {
    return ErrnoStatus(absl::StatusCode::kUnavailable, errno,
                       absl::StrCat("listen on abstract socket @", name));
  }
  return fd;
}

absl::StatusOr<UniqueFd> ConnectSeqpacket(const std::string& name, absl::Time deadline) {
  sockaddr_un address;
  absl::StatusOr<socklen_t> length = MakeAddress(name, &address);
  if (!length.ok()) return length.status();
  absl::StatusOr<UniqueFd> fd = NewSocket();
  if (!fd.ok()) return fd.status();
  while (true) {
    if (::connect(fd->get(), reinterpret_cast<const sockaddr*>(&address), *length) == 0) {
      return fd;
    }
    const int err = errno;
    // Unix sockets connect at once or fail; EAGAIN means the listener's backlog is full.
    if (err == EINTR) continue;
    if (err == EAGAIN && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
      continue;
    }
    return ErrnoStatus(
        err == EAGAIN ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kUnavailable, err,
        absl::StrCat("connect to abstract socket @", name));
  }
}

absl::StatusOr<UniqueFd> AcceptSeqpacket(int listener) {
  while (true) {
    UniqueFd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (fd.valid()) return fd;
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN) return absl::UnavailableError("no pending connection");
    return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "accept4");
  }
}

absl::Status SendMessage(int socket, absl::string_view bytes, int fd_to_pass, absl::Time deadline) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  if (fd_to_pass >= 0) {
    std::memset(control, 0, sizeof(control));
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(header), &fd_to_pass, sizeof(int));
  }
  while (true) {
    const ssize_t sent = ::sendmsg(socket, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent == static_cast<ssize_t>(bytes.size())) return absl::OkStatus();
    if (sent >= 0) {
      return absl::InternalError(
          absl::StrCat("sendmsg sent ", sent, " of ", bytes.size(), " bytes of one message"));
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN) {
      absl::StatusOr<bool> ready = WaitFor(socket, POLLOUT, deadline);
      if (!ready.ok()) return ready.status();
      if (!*ready) return absl::DeadlineExceededError("sendmsg: socket buffer full");
      continue;
    }
    return ErrnoStatus(absl::StatusCode::kUnavailable, errno, "sendmsg");
  }
}

absl::StatusOr<ReceivedMessage> ReceiveMessage(int socket, size_t max_bytes, absl::Time deadline) {
  // One byte more than allowed, so that an oversized message is recognised (MSG_TRUNC).
  std::string buffer(max_bytes + 1, '\0');
  absl::StatusOr<ReceivedView> view =
      ReceiveMessageInto(socket, absl::MakeSpan(buffer.data(), buffer.size()), deadline);
  if (!view.ok()) return view.status();
  ReceivedMessage out;
  out.eof = view->eof;
  out.fd = std::move(view->fd);
  buffer.resize(view->bytes.size());
  out.bytes = std::move(buffer);
  return out;
}

absl::StatusOr<ReceivedView> ReceiveMessageInto(int socket, absl::Span<char> buffer,
                                                absl::Time deadline) {
  if (buffer.empty()) return absl::InvalidArgumentError("no receive buffer");
  const size_t max_bytes = buffer.size() - 1;
  while (true) {
    iovec iov{buffer.data(), buffer.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    msghdr message{};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    const ssize_t received = ::recvmsg(socket, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (received < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        if (deadline == absl::InfinitePast()) {
          return absl::DeadlineExceededError("no message before the deadline");
        }
        absl::StatusOr<bool> ready = WaitFor(socket, POLLIN, deadline);
        if (!ready.ok()) return ready.status();
        if (!*ready) return absl::DeadlineExceededError("no message before the deadline");
        continue;
      }
      return ErrnoStatus(absl::StatusCode::kUnavailable, errno, "recvmsg");
    }
    ReceivedView out;
    // Take ownership of every descriptor first, so that none leaks on an error below.
    std::vector<UniqueFd> fds;
    for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
         header = CMSG_NXTHDR(&message, header)) {
      if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
        fds.emplace_back(fd);
      }
    }
    if (received == 0 && fds.empty()) {
      out.eof = true;
      return out;
    }
    if ((message.msg_flags & MSG_TRUNC) != 0 || static_cast<size_t>(received) > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("message longer than ", max_bytes, " bytes"));
    }
    if ((message.msg_flags & MSG_CTRUNC) != 0 || fds.size() > 1) {
      return absl::InvalidArgumentError("message carried more than one descriptor");
    }
    out.bytes = absl::string_view(buffer.data(), static_cast<size_t>(received));
    if (!fds.empty()) out.fd = std::move(fds[0]);
    return out;
  }
}

}  // namespace kvwire::transport::shm
