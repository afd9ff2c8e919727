#include "transport/shm/fd_server.h"

#include <sys/eventfd.h>
#include <sys/socket.h>

#include <cerrno>
#include <fcntl.h>
#include <optional>
#include <poll.h>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "transport/shm/errno_text.h"
#include "transport/shm/fd_protocol.h"
#include "transport/shm/seqpacket.h"

namespace kvwire::transport::shm {

struct FdServer::Connection {
  UniqueFd socket;
  std::optional<PeerId> peer;  // set by the first request with a valid token
  pid_t pid = 0;               // of the connecting process (SO_PEERCRED at accept), 0: unknown
};

namespace {

absl::Status Reply(int socket, const FdReply& reply, int fd) {
  // Never wait: replies are small and fit the socket buffer; a peer that does not read its
  // replies only hurts itself (its connection is closed).
  return SendMessage(socket, EncodeReply(reply), fd, absl::Now());
}

FdReply ErrorReply(RegionId region, const absl::Status& status) {
  FdReply reply;
  reply.code = status.code();
  reply.message = std::string(status.message());
  reply.region = region;
  return reply;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FdServer>> FdServer::Start(const std::string& socket_name,
                                                          TargetHooks* hooks,
                                                          const LocalRegionTable* regions,
                                                          size_t max_connections) {
  absl::StatusOr<UniqueFd> listener = ListenSeqpacket(socket_name, 64);
  if (!listener.ok()) return listener.status();
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "eventfd");
  auto server = std::make_unique<FdServer>(PassKey(), hooks, regions, max_connections,
                                           *std::move(listener), std::move(wake));
  MutexLock lock(&server->join_mu_);
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

FdServer::FdServer(PassKey, TargetHooks* hooks, const LocalRegionTable* regions,
                   size_t max_connections, UniqueFd listener, UniqueFd wake)
    : hooks_(hooks),
      regions_(regions),
      max_connections_(max_connections),
      listener_(std::move(listener)),
      wake_(std::move(wake)) {}

FdServer::~FdServer() { Shutdown(); }

void FdServer::Wake() {
  const uint64_t one = 1;
  // EAGAIN means the counter is already non-zero: the thread will wake anyway.
  ssize_t ignored = ::write(wake_.get(), &one, sizeof(one));
  (void)ignored;
}

void FdServer::DropPeer(PeerId peer) {
  {
    MutexLock lock(&mu_);
    dropped_.insert(peer);
  }
  Wake();
}

void FdServer::Shutdown() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  Wake();
  MutexLock lock(&join_mu_);
  if (thread_.joinable()) thread_.join();
}

bool FdServer::IsDropped(PeerId peer) {
  MutexLock lock(&mu_);
  return dropped_.contains(peer);
}

void FdServer::Run() {
  // Connections belong to this thread alone; they are closed when it returns.
  std::vector<Connection> connections;
  std::vector<pollfd> polled;
  while (true) {
    polled.clear();
    polled.push_back({wake_.get(), POLLIN, 0});
    polled.push_back({listener_.get(), POLLIN, 0});
    for (const Connection& connection : connections) {
      polled.push_back({connection.socket.get(), POLLIN, 0});
    }
    if (::poll(polled.data(), polled.size(), -1) < 0) {
      if (errno == EINTR) continue;
      KVW_LOG(kError, "shm") << "fd server poll failed, stopping" << Kv("error", ErrnoText(errno));
      return;
    }
    if (polled[0].revents != 0) {
      uint64_t count;
      ssize_t ignored = ::read(wake_.get(), &count, sizeof(count));
      (void)ignored;
      absl::flat_hash_set<PeerId> dropped;
      {
        MutexLock lock(&mu_);
        if (stopping_) return;
        dropped = dropped_;
      }
      // Close the connections of dropped peers.
      std::erase_if(connections, [&dropped](const Connection& c) {
        return c.peer.has_value() && dropped.contains(*c.peer);
      });
      // Indices into `polled` no longer match `connections`: poll again.
      continue;
    }
    // Serve before accepting: `polled` indices refer to the connections as they were.
    std::vector<bool> keep(connections.size(), true);
    for (size_t i = 0; i < connections.size(); ++i) {
      if (polled[i + 2].revents != 0) keep[i] = Serve(connections[i]);
    }
    size_t next = 0;
    std::erase_if(connections, [&](const Connection&) { return !keep[next++]; });
    if (polled[1].revents != 0) {
      while (true) {
        absl::StatusOr<UniqueFd> accepted = AcceptSeqpacket(listener_.get());
        if (!accepted.ok()) {
          if (!absl::IsUnavailable(accepted.status())) {
            KVW_LOG(kWarning, "shm") << "accept failed" << Kv("error", accepted.status());
          }
          break;
        }
        if (connections.size() >= max_connections_) {
          KVW_LOG(kWarning, "shm")
              << "refusing connection: too many" << Kv("limit", max_connections_);
          continue;  // `accepted` closes it
        }
        ucred credentials{};
        socklen_t size = sizeof(credentials);
        if (::getsockopt(accepted->get(), SOL_SOCKET, SO_PEERCRED, &credentials, &size) != 0) {
          KVW_LOG(kWarning, "shm")
              << "refusing connection: SO_PEERCRED failed" << Kv("error", ErrnoText(errno));
          continue;
        }
        connections.push_back(Connection{*std::move(accepted), std::nullopt, credentials.pid});
      }
    }
  }
}

bool FdServer::Serve(Connection& connection) {
  const int socket = connection.socket.get();
  // Any descriptor a client attaches is closed with `message`.
  absl::StatusOr<ReceivedMessage> message = ReceiveMessage(socket, kMaxFdMessageBytes, absl::Now());
  if (absl::IsDeadlineExceeded(message.status())) return true;  // woken without data
  if (!message.ok() || message->eof) {
    if (!message.ok() && connection.peer.has_value()) {
      hooks_->OnPeerError(*connection.peer, message.status());
    }
    return false;
  }
  absl::StatusOr<FdRequest> request = DecodeRequest(message->bytes);
  if (!request.ok()) {
    KVW_LOG(kWarning, "shm") << "malformed fd request" << Kv("error", request.status());
    if (connection.peer.has_value()) hooks_->OnPeerError(*connection.peer, request.status());
    return false;
  }
  absl::StatusOr<PeerId> peer = hooks_->PeerForToken(request->token);
  if (!peer.ok()) {
    KVW_LOG(kWarning, "shm") << "fd request with an unknown token refused"
                             << Kv("error", peer.status());
    (void)Reply(socket, ErrorReply(request->region, peer.status()), -1);
    return false;
  }
  if (connection.peer.has_value() && *connection.peer != *peer) {
    const absl::Status error = absl::PermissionDeniedError(absl::StrCat(
        "shm: connection of peer ", *connection.peer, " presented the token of peer ", *peer));
    (void)Reply(socket, ErrorReply(request->region, error), -1);
    hooks_->OnPeerError(*connection.peer, error);
    return false;
  }
  // The token is bound to the process that handshook: another process that learned it (from
  // the control connection, or a log) gets nothing. Checked on every request: the engine may
  // learn the pid only after the first one (0 = not known yet).
  const uint32_t expected = hooks_->PeerProcessId(*peer);
  if (expected != 0 && static_cast<uint32_t>(connection.pid) != expected) {
    const absl::Status error = absl::PermissionDeniedError(
        absl::StrCat("shm: the session token of peer ", *peer, " was presented by pid ",
                     connection.pid, ", but the peer handshook from pid ", expected));
    KVW_LOG(kWarning, "shm") << "fd request refused" << Kv("error", error);
    (void)Reply(socket, ErrorReply(request->region, error), -1);
    return false;
  }
  if (IsDropped(*peer)) {
    (void)Reply(socket,
                ErrorReply(request->region, absl::UnavailableError(
                                                absl::StrCat("shm: peer ", *peer, " was dropped"))),
                -1);
    return false;
  }
  connection.peer = *peer;
  if (request->kind == FdRequestKind::kHello) {
    FdReply welcome;
    welcome.region = request->region;
    return Reply(socket, welcome, -1).ok();
  }

  const RegionId region_id = request->region;
  // The engine's verdict first: exported to this peer, and with which rights.
  absl::StatusOr<LocalRegion> region = hooks_->ExportedRegion(*peer, region_id);
  if (!region.ok()) {
    return Reply(socket, ErrorReply(region_id, region.status()), -1).ok();
  }
  std::shared_ptr<const LocalRegionEntry> entry = regions_->Find(region_id);
  absl::Status refused;
  if (entry == nullptr) {
    refused = absl::NotFoundError(
        absl::StrCat("shm: region ", region_id, " is not registered with the shm transport"));
  } else if (!entry->not_shared.empty()) {
    refused = absl::FailedPreconditionError(entry->not_shared);
  } else if (!entry->memfd.valid()) {
    refused = absl::FailedPreconditionError(absl::StrCat(
        "shm: region ", region_id,
        " is not memfd-backed (allocate it with kvwire::ShareableBuffer to share it over shm)"));
  }
  if (!refused.ok()) return Reply(socket, ErrorReply(region_id, refused), -1).ok();

  FdReply reply;
  reply.region = region_id;
  reply.memfd_offset = entry->memfd_offset;
  reply.length = entry->length;
  reply.access = entry->access & region->access;
  // Without write permission the peer gets a read-only descriptor of the same memfd. That
  // alone would not stop it (it can reopen the descriptor read-write through /proc): the
  // memfd's F_SEAL_FUTURE_WRITE does (LocalRegionTable::Add).
  UniqueFd read_only;
  int fd = entry->memfd.get();
  if ((reply.access & kRemoteWrite) == 0) {
    // The engine may export with fewer rights than the region was registered with: a
    // read-only reply over a memfd that is not sealed against writes would still be writable.
    const int seals = ::fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) == 0) {
      const absl::Status error = absl::FailedPreconditionError(absl::StrCat(
          "shm: region ", region_id,
          " is exported read-only but its memfd is not sealed against writes; not shared"));
      return Reply(socket, ErrorReply(region_id, error), -1).ok();
    }
    const std::string path = absl::StrCat("/proc/self/fd/", entry->memfd.get());
    read_only.Reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!read_only.valid()) {
      const absl::Status error = ErrnoStatus(
          absl::StatusCode::kInternal, errno,
          absl::StrCat("shm: region ", region_id, ": reopening memfd read-only via ", path));
      return Reply(socket, ErrorReply(region_id, error), -1).ok();
    }
    fd = read_only.get();
  }
  const absl::Status sent = Reply(socket, reply, fd);
  KVW_LOG(kDebug, "shm") << "served region memfd" << Kv("peer", *peer) << Kv("region", region_id)
                         << Kv("length", reply.length) << Kv("access", reply.access)
                         << Kv("status", sent);
  return sent.ok();
}

}  // namespace kvwire::transport::shm
