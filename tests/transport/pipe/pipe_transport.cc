#include "tests/transport/pipe/pipe_transport.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"

#include "src/util/mutex.h"
#include "src/util/option_range.h"
#include "transport/transport.h"

namespace kvwire::testing {
namespace {

using transport::Capabilities;
using transport::Channel;
using transport::DoneCallback;
using transport::PeerLink;
using transport::PostRequest;
using transport::RemoteRegionDesc;
using transport::TargetHooks;
using transport::Transport;

constexpr uint64_t kMaxOpBytes = 64 << 20;
constexpr uint32_t kMaxTokenBytes = 256;
constexpr uint32_t kMaxMessageBytes = 4096;
constexpr char kEndpointPrefix[] = "kvwire-pipe-";
// Every blocking call on a data socket gives up after this: a peer that stops answering
// costs an op, never a thread forever.
constexpr int kIoTimeoutSeconds = 10;

// Initiator -> target, one per op; both ends run on one host, so host byte order.
struct OpHeader {
  uint8_t kind = 0;  // OpKind
  uint8_t count_arrivals = 0;
  uint8_t pad[6] = {};
  uint64_t transfer_id = 0;
  uint64_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Target -> initiator: the status of the hello or of an op (then a READ's data follows).
struct Reply {
  int32_t code = 0;  // absl::StatusCode
  uint32_t message_length = 0;
};

bool SendAll(int fd, const void* data, size_t n) {
  auto* p = static_cast<const std::byte*>(data);
  while (n > 0) {
    const ssize_t sent = ::send(fd, p, n, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    p += sent;
    n -= static_cast<size_t>(sent);
  }
  return true;
}

bool RecvAll(int fd, void* data, size_t n) {
  auto* p = static_cast<std::byte*>(data);
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool Drain(int fd, uint64_t n) {
  std::byte sink[64 << 10];
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, sizeof(sink)));
    if (!RecvAll(fd, sink, chunk)) return false;
    n -= chunk;
  }
  return true;
}

bool SendStatus(int fd, const absl::Status& status) {
  const std::string message(status.message().substr(0, kMaxMessageBytes));
  Reply reply;
  reply.code = static_cast<int32_t>(status.code());
  reply.message_length = static_cast<uint32_t>(message.size());
  return SendAll(fd, &reply, sizeof(reply)) && SendAll(fd, message.data(), message.size());
}

// The status a Reply carries; Unavailable when the connection broke on the way.
absl::Status ReceiveStatus(int fd) {
  Reply reply;
  if (!RecvAll(fd, &reply, sizeof(reply))) {
    return absl::UnavailableError("pipe: connection lost while waiting for the target's answer");
  }
  if (reply.message_length > kMaxMessageBytes || reply.code < 0 || reply.code > 16) {
    return absl::InternalError("pipe: malformed answer from the target");
  }
  std::string message(reply.message_length, '\0');
  if (!RecvAll(fd, message.data(), message.size())) {
    return absl::UnavailableError("pipe: connection lost while reading the target's answer");
  }
  return absl::Status(static_cast<absl::StatusCode>(reply.code), message);
}

void SetTimeouts(int fd) {
  timeval tv{};
  tv.tv_sec = kIoTimeoutSeconds;
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// An abstract-namespace address: nothing in the file system to clean up.
socklen_t AbstractAddress(const std::string& name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(addr->sun_path) - 1);
  std::memcpy(addr->sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat("pipe: ", what, ": ", std::strerror(errno)));
}

// Initiator side: one connection, one thread that runs the posted requests in order.
class PipeChannel final : public Channel {
 public:
  PipeChannel(int fd, std::string description)
      : fd_(fd), description_(std::move(description)), worker_([this] { Run(); }) {}

  ~PipeChannel() override {
    Close(absl::CancelledError("pipe channel destroyed"));
    worker_.join();
    ::close(fd_);
  }

  void Post(PostRequest request, DoneCallback done) override {
    absl::Status closed;
    {
      MutexLock lock(&mu_);
      if (closed_.ok()) {
        queue_.push_back(Item{std::move(request), std::move(done)});
        cv_.Signal();
        return;
      }
      closed = closed_;
    }
    done(closed);
  }

  // The target validates every op itself: no per-region state here.
  absl::Status AddRemoteRegions(const std::vector<RemoteRegionDesc>&) override {
    return absl::OkStatus();
  }
  void RemoveRemoteRegions(const std::vector<RegionId>&) override {}

  void Close(const absl::Status& reason) override {
    MutexLock lock(&mu_);
    if (!closed_.ok()) return;
    closed_ = reason.ok() ? absl::CancelledError("pipe channel closed") : reason;
    ::shutdown(fd_, SHUT_RDWR);  // wakes the worker if it is blocked on the socket
    cv_.SignalAll();
  }

  std::string Describe() const override { return description_; }

 private:
  struct Item {
    PostRequest request;
    DoneCallback done;
  };

  void Run() {
    while (true) {
      Item item;
      absl::Status closed;
      {
        MutexLock lock(&mu_);
        while (queue_.empty() && closed_.ok()) cv_.Wait(&mu_);
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        closed = closed_;
      }
      absl::Status status = closed.ok() ? Execute(item.request) : closed;
      if (status.code() == absl::StatusCode::kUnavailable) Close(status);
      item.done(status);
    }
  }

  absl::Status Execute(const PostRequest& request) {
    for (const transport::WireOp& op : request.ops) {
      OpHeader header;
      header.kind = static_cast<uint8_t>(request.kind);
      header.count_arrivals = request.count_arrivals ? 1 : 0;
      header.transfer_id = request.transfer_id;
      header.region = op.remote_region;
      header.offset = op.remote_offset;
      header.length = op.length;
      if (!SendAll(fd_, &header, sizeof(header))) return Errno("sending an op");
      if (request.kind == OpKind::kWrite && !SendAll(fd_, op.local, op.length)) {
        return Errno("sending a WRITE's data");
      }
      if (absl::Status s = ReceiveStatus(fd_); !s.ok()) return s;
      if (request.kind == OpKind::kRead) {
        // A transfer that already ended must not see its memory written any more.
        const bool cancelled = request.cancelled && request.cancelled->load();
        if (!(cancelled ? Drain(fd_, op.length) : RecvAll(fd_, op.local, op.length))) {
          return Errno("receiving a READ's data");
        }
      }
    }
    return absl::OkStatus();
  }

  const int fd_;
  const std::string description_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status closed_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

// Target side: a listener and one thread per incoming connection.
class PipeTransport final : public Transport {
 public:
  PipeTransport(TargetHooks* hooks, const PipeOptions& options) : hooks_(hooks) {
    caps_.name = kPipeTransportName;
    caps_.rank = static_cast<uint32_t>(options.rank);
    caps_.same_host_only = true;
    caps_.reaches_every_region = true;
    caps_.counts_arrivals = true;
    caps_.max_op_bytes = kMaxOpBytes;
    caps_.max_lanes = 1;
    caps_.lanes_per_peer = 1;
    caps_.host_memory = true;
    caps_.gpu_memory = false;
  }

  ~PipeTransport() override { Shutdown(); }

  absl::Status Listen() {
    static std::atomic<uint64_t> next{0};
    endpoint_ = absl::StrCat(kEndpointPrefix, getpid(), "-", next++, "-",
                             reinterpret_cast<uintptr_t>(this));
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return Errno("socket");
    sockaddr_un addr;
    const socklen_t len = AbstractAddress(endpoint_, &addr);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) return Errno("bind");
    if (::listen(listen_fd_, 64) != 0) return Errno("listen");
    acceptor_ = std::thread([this] { Accept(); });
    return absl::OkStatus();
  }

  const Capabilities& caps() const override { return caps_; }
  std::string Endpoint() const override { return endpoint_; }
  absl::Status RegisterRegion(const transport::LocalRegion&) override { return absl::OkStatus(); }
  void DeregisterRegion(RegionId) override {}

  absl::Status CanReach(const std::string& remote_endpoint) const override {
    if (remote_endpoint.rfind(kEndpointPrefix, 0) != 0 || remote_endpoint.size() > 100) {
      return absl::InvalidArgumentError("not a pipe endpoint");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Channel>> Connect(const PeerLink& link) override {
    if (link.token.size() > kMaxTokenBytes) return absl::InvalidArgumentError("token too long");
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Errno("socket");
    SetTimeouts(fd);
    sockaddr_un addr;
    const socklen_t len = AbstractAddress(link.remote_endpoint, &addr);
    const uint32_t token_length = static_cast<uint32_t>(link.token.size());
    absl::Status status;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      status = Errno(absl::StrCat("connect to ", link.remote_endpoint));
    } else if (!SendAll(fd, &token_length, sizeof(token_length)) ||
               !SendAll(fd, link.token.data(), link.token.size())) {
      status = Errno("sending the session token");
    } else {
      status = ReceiveStatus(fd);  // the target's verdict on the token
    }
    if (!status.ok()) {
      ::close(fd);
      return status;
    }
    return std::make_unique<PipeChannel>(fd, absl::StrCat("pipe ", link.remote_endpoint));
  }

  void DropPeer(PeerId peer) override {
    MutexLock lock(&mu_);
    for (Connection& c : connections_) {
      if (c.peer == peer) ::shutdown(c.fd, SHUT_RDWR);
    }
  }

  void Shutdown() override {
    std::list<Connection> connections;
    {
      MutexLock lock(&mu_);
      if (stopped_) return;
      stopped_ = true;
      if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);  // accept() returns
      for (Connection& c : connections_) ::shutdown(c.fd, SHUT_RDWR);
    }
    if (acceptor_.joinable()) acceptor_.join();
    {
      MutexLock lock(&mu_);
      connections.swap(connections_);
    }
    for (Connection& c : connections) {
      c.thread.join();
      ::close(c.fd);
    }
    if (listen_fd_ >= 0) ::close(listen_fd_);
    listen_fd_ = -1;
  }

 private:
  struct Connection {
    int fd = -1;
    PeerId peer = 0;  // 0 until its token is known
    std::thread thread;
  };

  void Accept() {
    while (true) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0 && errno == EINTR) continue;
      if (fd < 0) return;  // shut down
      SetTimeouts(fd);
      MutexLock lock(&mu_);
      if (stopped_) {
        ::close(fd);
        return;
      }
      connections_.emplace_back();
      Connection* c = &connections_.back();
      c->fd = fd;
      c->thread = std::thread([this, c] { Serve(c); });
    }
  }

  void Serve(Connection* c) {
    const int fd = c->fd;
    uint32_t token_length = 0;
    if (!RecvAll(fd, &token_length, sizeof(token_length)) || token_length > kMaxTokenBytes) {
      return;
    }
    std::string token(token_length, '\0');
    if (!RecvAll(fd, token.data(), token.size())) return;
    absl::StatusOr<PeerId> peer = hooks_->PeerForToken(token);
    if (!peer.ok()) {
      (void)SendStatus(fd, peer.status());
      return;
    }
    {
      MutexLock lock(&mu_);
      c->peer = *peer;
    }
    if (!SendStatus(fd, absl::OkStatus())) return;
    while (true) {
      OpHeader h;
      if (!RecvAll(fd, &h, sizeof(h))) return;
      if (h.kind > 1 || h.length > kMaxOpBytes) {
        hooks_->OnPeerError(
            *peer, absl::InvalidArgumentError(absl::StrCat("pipe: malformed op (kind ", h.kind,
                                                           ", length ", h.length, ")")));
        return;
      }
      const OpKind kind = static_cast<OpKind>(h.kind);
      absl::StatusOr<transport::IncomingAccess> access =
          hooks_->ResolveIncoming(*peer, h.region, h.offset, h.length, kind);
      if (access.ok() && access->gpu_device >= 0) {
        access = absl::FailedPreconditionError("pipe: cannot move GPU memory");
      }
      if (!access.ok()) {
        // The initiator sends a WRITE's data regardless: take it, then refuse the op.
        if (kind == OpKind::kWrite && !Drain(fd, h.length)) return;
        if (!SendStatus(fd, access.status())) return;
        continue;
      }
      if (kind == OpKind::kWrite) {
        if (!RecvAll(fd, access->data, h.length)) return;
        if (h.count_arrivals) hooks_->OnWriteArrived(*peer, h.transfer_id);
        if (!SendStatus(fd, absl::OkStatus())) return;
      } else if (!SendStatus(fd, absl::OkStatus()) || !SendAll(fd, access->data, h.length)) {
        return;
      }
    }
  }

  TargetHooks* const hooks_;
  Capabilities caps_;
  std::string endpoint_;
  int listen_fd_ = -1;
  std::thread acceptor_;
  Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

TransportFactory PipeTransportFactory() {
  return
      [](const transport::TransportContext& context) -> absl::StatusOr<std::unique_ptr<Transport>> {
        auto pipe = std::make_unique<PipeTransport>(context.hooks,
                                                    context.options->transports.Get<PipeOptions>());
        if (absl::Status s = pipe->Listen(); !s.ok()) return s;
        return std::unique_ptr<Transport>(std::move(pipe));
      };
}

void AddPipeTransport(EngineOptions* options) {
  options->extra_transports.push_back(PipeTransportFactory());
  options->transports.Get<PipeOptions>();
}

absl::Status PipeOptions::Validate() const { return CheckOptionRange("pipe.rank", rank, 1, 1000); }

absl::Status PipeOptions::Set(absl::string_view key, absl::string_view value) {
  return SetOptionByName(kName, key, value, [this](auto&& f) { f("rank", rank); });
}

absl::Status PipeOptions::Get(absl::string_view key, std::string* value) const {
  return GetOptionByName(kName, key, value, [this](auto&& f) { f("rank", rank); });
}

std::vector<std::string> PipeOptions::Keys() const { return {"rank"}; }

}  // namespace kvwire::testing
