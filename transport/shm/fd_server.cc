#include "transport/shm/fd_server.h"

#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <fcntl.h>
#include <limits>
#include <optional>
#include <poll.h>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "transport/shm/errno_text.h"
#include "transport/shm/fd_protocol.h"
#include "transport/shm/seqpacket.h"
#include "transport/shm/served_copy.h"
#include "transport/shm/shareable_registry.h"

namespace kvwire::transport::shm {

struct FdServer::Connection {
  UniqueFd socket;
  std::optional<PeerId> peer;  // set by the first request with a valid token
  pid_t pid = 0;               // of the connecting process (SO_PEERCRED at accept), 0: unknown
  uid_t uid = 0;               // of the connecting process (SO_PEERCRED at accept)
  absl::Time auth_deadline;    // closed unless `peer` is set by then
  // A request with a valid token whose peer's handshake pid is not known yet (the engine
  // publishes the peer when its side of the handshake completes, which may be after the other
  // side already asks): retried until `auth_deadline`, then refused.
  std::optional<FdRequest> waiting;
  PeerId waiting_peer = 0;
  // Served copies (served_copy.h): made at the peer's first kStaging request.
  std::unique_ptr<CopyStaging> staging;
};

namespace {

absl::Status Reply(int socket, const FdReply& reply, int fd) {
  // Never wait: replies are small and fit the socket buffer; a peer that does not read its
  // replies only hurts itself (its connection is closed).
  // Encoded into storage this thread keeps (the server's, or a test's): a served copy sends one
  // reply per piece, and none allocates once it has grown.
  thread_local std::string encoded;
  EncodeReplyTo(reply, &encoded);
  return SendMessage(socket, encoded, fd, absl::Now());
}

FdReply ErrorReply(RegionId region, const absl::Status& status) {
  FdReply reply;
  reply.code = status.code();
  reply.message = std::string(status.message());
  reply.region = region;
  return reply;
}

}  // namespace

// How often a request waiting for its peer's handshake pid is retried.
constexpr absl::Duration kPidRetry = absl::Milliseconds(5);

absl::StatusOr<std::unique_ptr<FdServer>> FdServer::Start(
    const std::string& socket_name, TargetHooks* hooks, LocalRegionTable* regions,
    const FdServerLimits& limits, std::shared_ptr<ServedCopyCounters> counters) {
  if (limits.max_connections == 0 || limits.max_unauthenticated_per_uid == 0 ||
      limits.max_stagings_per_process == 0 || limits.auth_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: max_connections (", limits.max_connections, "), max_unauthenticated_per_uid (",
        limits.max_unauthenticated_per_uid, ") and max_stagings_per_process (",
        limits.max_stagings_per_process, ") must be at least 1 and auth_timeout (",
        absl::FormatDuration(limits.auth_timeout), ") positive"));
  }
  absl::StatusOr<UniqueFd> listener = ListenSeqpacket(socket_name, 64);
  if (!listener.ok()) return listener.status();
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno, "eventfd");
  auto server = std::make_unique<FdServer>(PassKey(), hooks, regions, limits, *std::move(listener),
                                           std::move(wake), std::move(counters));
  MutexLock lock(&server->join_mu_);
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

FdServer::FdServer(PassKey, TargetHooks* hooks, LocalRegionTable* regions,
                   const FdServerLimits& limits, UniqueFd listener, UniqueFd wake,
                   std::shared_ptr<ServedCopyCounters> counters)
    : hooks_(hooks),
      regions_(regions),
      limits_(limits),
      listener_(std::move(listener)),
      wake_(std::move(wake)),
      counters_(std::move(counters)) {}

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
    dropped_.Insert(peer);
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
  return dropped_.Contains(peer);
}

void FdServer::Run() {
  // Connections belong to this thread alone; they are closed when it returns.
  std::vector<Connection> connections;
  std::vector<pollfd> polled;
  while (true) {
    // Wake for the first authentication deadline, and to retry requests waiting for a pid.
    absl::Time wake_at = absl::InfiniteFuture();
    const absl::Time now = absl::Now();
    polled.clear();
    polled.push_back({wake_.get(), POLLIN, 0});
    polled.push_back({listener_.get(), POLLIN, 0});
    for (const Connection& connection : connections) {
      if (!connection.peer.has_value()) wake_at = std::min(wake_at, connection.auth_deadline);
      if (connection.waiting.has_value()) wake_at = std::min(wake_at, now + kPidRetry);
      // A waiting connection is not read further until its request is answered.
      polled.push_back(
          {connection.socket.get(), static_cast<short>(connection.waiting ? 0 : POLLIN), 0});
    }
    int timeout_ms = -1;
    if (wake_at != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(wake_at - now, absl::Milliseconds(1))), 0,
          std::numeric_limits<int>::max()));
    }
    if (::poll(polled.data(), polled.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      KVW_LOG(kError, "shm") << "fd server poll failed, stopping" << Kv("error", ErrnoText(errno));
      return;
    }
    if (polled[0].revents != 0) {
      uint64_t count;
      ssize_t ignored = ::read(wake_.get(), &count, sizeof(count));
      (void)ignored;
      MutexLock lock(&mu_);
      if (stopping_) return;
      // Close the connections of dropped peers.
      for (auto it = connections.begin(); it != connections.end();) {
        it = it->peer.has_value() && dropped_.Contains(*it->peer) ? connections.erase(it) : it + 1;
      }
      // Indices into `polled` no longer match `connections`: poll again.
      continue;
    }
    // Serve before accepting: `polled` indices refer to the connections as they were.
    std::vector<bool> keep(connections.size(), true);
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& connection = connections[i];
      const short revents = polled[i + 2].revents;
      if (connection.waiting.has_value()) {
        if ((revents & (POLLHUP | POLLERR)) != 0) {
          keep[i] = false;
        } else {
          FdRequest request = *std::exchange(connection.waiting, std::nullopt);
          keep[i] = Handle(connection, request, connections);
        }
      } else if (revents != 0) {
        keep[i] = Serve(connection, connections);
      }
    }
    const absl::Time after = absl::Now();
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& connection = connections[i];
      if (!keep[i] || connection.peer.has_value() || after < connection.auth_deadline) continue;
      keep[i] = false;
      absl::Status error;
      if (connection.waiting.has_value()) {
        error = absl::PermissionDeniedError(
            absl::StrCat("shm: the session token of peer ", connection.waiting_peer,
                         " was presented, but that peer's handshake pid was not known within ",
                         absl::FormatDuration(limits_.auth_timeout),
                         " (handshake not complete, or it announced no pid); refused"));
        (void)Reply(connection.socket.get(), ErrorReply(connection.waiting->region, error), -1);
      } else {
        error = absl::DeadlineExceededError(
            absl::StrCat("shm: connection presented no valid session token within ",
                         absl::FormatDuration(limits_.auth_timeout), "; closed"));
      }
      KVW_LOG(kWarning, "shm") << "closing unauthenticated connection" << Kv("pid", connection.pid)
                               << Kv("uid", connection.uid) << Kv("error", error);
    }
    size_t next = 0;
    std::erase_if(connections, [&](const Connection&) { return !keep[next++]; });
    if (polled[1].revents != 0) AcceptAll(connections);
  }
}

void FdServer::AcceptAll(std::vector<Connection>& connections) {
  while (true) {
    absl::StatusOr<UniqueFd> accepted = AcceptSeqpacket(listener_.get());
    if (!accepted.ok()) {
      if (!absl::IsUnavailable(accepted.status())) {
        KVW_LOG(kWarning, "shm") << "accept failed" << Kv("error", accepted.status());
      }
      return;
    }
    if (connections.size() >= limits_.max_connections) {
      KVW_LOG(kWarning, "shm") << "refusing connection: too many"
                               << Kv("limit", limits_.max_connections);
      continue;  // `accepted` closes it
    }
    ucred credentials{};
    socklen_t size = sizeof(credentials);
    if (::getsockopt(accepted->get(), SOL_SOCKET, SO_PEERCRED, &credentials, &size) != 0) {
      KVW_LOG(kWarning, "shm") << "refusing connection: SO_PEERCRED failed"
                               << Kv("error", ErrnoText(errno));
      continue;
    }
    const size_t unauthenticated =
        std::count_if(connections.begin(), connections.end(), [&credentials](const Connection& c) {
          return !c.peer.has_value() && c.uid == credentials.uid;
        });
    if (unauthenticated >= limits_.max_unauthenticated_per_uid) {
      KVW_LOG(kWarning, "shm") << "refusing connection: too many without a valid token from uid"
                               << Kv("uid", credentials.uid)
                               << Kv("limit", limits_.max_unauthenticated_per_uid);
      continue;
    }
    Connection connection;
    connection.socket = *std::move(accepted);
    connection.pid = credentials.pid;
    connection.uid = credentials.uid;
    connection.auth_deadline = absl::Now() + limits_.auth_timeout;
    connections.push_back(std::move(connection));
  }
}

bool FdServer::Serve(Connection& connection, const std::vector<Connection>& all) {
  const int socket = connection.socket.get();
  // Any descriptor a client attaches is closed with `message`.
  absl::StatusOr<ReceivedView> message =
      ReceiveMessageInto(socket, absl::MakeSpan(received_), absl::InfinitePast());
  if (absl::IsDeadlineExceeded(message.status())) return true;  // woken without data
  if (!message.ok() || message->eof) {
    if (!message.ok() && connection.peer.has_value()) {
      hooks_->OnPeerError(*connection.peer, message.status());
    }
    return false;
  }
  if (absl::Status decoded = DecodeRequestInto(message->bytes, &request_); !decoded.ok()) {
    KVW_LOG(kWarning, "shm") << "malformed fd request" << Kv("error", decoded);
    if (connection.peer.has_value()) hooks_->OnPeerError(*connection.peer, decoded);
    return false;
  }
  return Handle(connection, request_, all);
}

bool FdServer::Handle(Connection& connection, const FdRequest& request,
                      const std::vector<Connection>& all) {
  const int socket = connection.socket.get();
  absl::StatusOr<PeerId> peer = hooks_->PeerForToken(request.token);
  if (!peer.ok()) {
    KVW_LOG(kWarning, "shm") << "fd request with an unknown token refused"
                             << Kv("error", peer.status());
    (void)Reply(socket, ErrorReply(request.region, peer.status()), -1);
    return false;
  }
  if (connection.peer.has_value() && *connection.peer != *peer) {
    const absl::Status error = absl::PermissionDeniedError(absl::StrCat(
        "shm: connection of peer ", *connection.peer, " presented the token of peer ", *peer));
    (void)Reply(socket, ErrorReply(request.region, error), -1);
    hooks_->OnPeerError(*connection.peer, error);
    return false;
  }
  // The token is bound to the process that handshook: another process that learned it (from
  // the control connection, or a log) gets nothing. Checked on every request. The engine may
  // learn the pid only after the first request (0 = not known yet): that request waits, and is
  // refused at the connection's authentication deadline if the pid is still unknown; never
  // served unchecked.
  const uint32_t expected = hooks_->PeerProcessId(*peer);
  if (expected == 0) {
    if (!connection.peer.has_value()) {
      connection.waiting = request;
      connection.waiting_peer = *peer;
      return true;
    }
    const absl::Status error = absl::PermissionDeniedError(
        absl::StrCat("shm: the handshake pid of peer ", *peer, " is no longer known; refused"));
    (void)Reply(socket, ErrorReply(request.region, error), -1);
    return false;
  }
  if (static_cast<uint32_t>(connection.pid) != expected) {
    const absl::Status error = absl::PermissionDeniedError(
        absl::StrCat("shm: the session token of peer ", *peer, " was presented by pid ",
                     connection.pid, ", but the peer handshook from pid ", expected));
    KVW_LOG(kWarning, "shm") << "fd request refused" << Kv("error", error);
    (void)Reply(socket, ErrorReply(request.region, error), -1);
    return false;
  }
  if (IsDropped(*peer)) {
    (void)Reply(socket,
                ErrorReply(request.region, absl::UnavailableError(
                                               absl::StrCat("shm: peer ", *peer, " was dropped"))),
                -1);
    return false;
  }
  connection.peer = *peer;
  if (request.kind == FdRequestKind::kHello) {
    // The epoch table comes with the welcome: the peer checks its word around every copy
    // from a mapped region (shareable_registry.h).
    absl::StatusOr<int> table = EpochTableFd();
    if (!table.ok()) return Reply(socket, ErrorReply(request.region, table.status()), -1).ok();
    FdReply welcome;
    welcome.region = request.region;
    welcome.length = kEpochTableBytes;
    return Reply(socket, welcome, *table).ok();
  }
  if (request.kind == FdRequestKind::kStaging) {
    if (connection.staging == nullptr) {
      // One staging memfd per peer: a peer's engine uses one served link per channel, so a
      // second would only be a peer claiming another kCopySlots x kCopySlotBytes per
      // connection it can open (up to max_connections of them).
      const bool held_elsewhere = std::any_of(all.begin(), all.end(), [&](const Connection& c) {
        return &c != &connection && c.staging != nullptr && c.peer == connection.peer;
      });
      // And a bound per process: one may handshake as many peers as it likes.
      const size_t held_by_process = std::count_if(
          all.begin(), all.end(),
          [&](const Connection& c) { return c.staging != nullptr && c.pid == connection.pid; });
      if (held_elsewhere) {
        const absl::Status error = absl::ResourceExhaustedError(
            absl::StrCat("shm: peer ", *peer,
                         " asked for a second staging memfd (one per peer, held by "
                         "another of its connections)"));
        (void)Reply(socket, ErrorReply(request.region, error), -1);
        hooks_->OnPeerError(*peer, error);
        return false;
      }
      if (held_by_process >= limits_.max_stagings_per_process) {
        // Not the peer's fault (its process may hold many engines): refused, not reported; it
        // may ask again once one of them let go.
        return Reply(socket,
                     ErrorReply(request.region,
                                absl::ResourceExhaustedError(absl::StrCat(
                                    "shm: peer ", *peer,
                                    " asked for a staging memfd while its "
                                    "process (pid ",
                                    connection.pid, ") holds ", held_by_process,
                                    ", the most one process may hold; ask again later"))),
                     -1)
            .ok();
      }
      absl::StatusOr<std::unique_ptr<CopyStaging>> staging = CopyStaging::Create();
      if (!staging.ok())
        return Reply(socket, ErrorReply(request.region, staging.status()), -1).ok();
      connection.staging = *std::move(staging);
    }
    FdReply reply;
    reply.region = request.region;
    reply.length = kCopySlotBytes;
    reply.flags = kCopySlots;
    return Reply(socket, reply, connection.staging->fd()).ok();
  }
  if (request.kind == FdRequestKind::kCopy) {
    if (connection.staging == nullptr) {
      const absl::Status error =
          absl::FailedPreconditionError("shm: a copy request before the staging memfd was asked");
      (void)Reply(socket, ErrorReply(request.region, error), -1);
      hooks_->OnPeerError(*peer, error);
      return false;
    }
    absl::Status refused;
    const FdReply reply = ServeCopy(*hooks_, *peer, *connection.staging, request, &refused);
    // Counted before the answer leaves: the peer may read the stats once it has it.
    if (counters_ != nullptr) {
      if (!refused.ok()) {
        counters_->refused.fetch_add(1, std::memory_order_relaxed);
      } else if (reply.code == absl::StatusCode::kOk) {
        uint64_t bytes = 0;
        for (const CopyOp& op : request.ops) bytes += op.length;
        counters_->answered.fetch_add(1, std::memory_order_relaxed);
        counters_->answered_bytes.fetch_add(bytes, std::memory_order_relaxed);
      }
    }
    const bool sent = Reply(socket, reply, -1).ok();
    if (!refused.ok()) {
      KVW_LOG(kWarning, "shm") << "copy request refused" << Kv("peer", *peer)
                               << Kv("error", reply.message);
      hooks_->OnPeerError(*peer, absl::Status(refused.code(), reply.message));
      return false;
    }
    return sent;
  }

  const RegionId region_id = request.region;
  const PeerId served_peer = *peer;
  // The engine's verdict (exported to this peer, with which rights), the record that the peer
  // holds the memfd, and the memfd itself, in one step against revocation (Serve).
  absl::StatusOr<LocalRegionTable::Served> served =
      regions_->Serve(region_id, served_peer, [&]() -> absl::StatusOr<LocalRegion> {
        if (IsDropped(served_peer)) {
          return absl::UnavailableError(absl::StrCat("shm: peer ", served_peer, " was dropped"));
        }
        return hooks_->ExportedRegion(served_peer, region_id);
      });
  if (!served.ok()) return Reply(socket, ErrorReply(region_id, served.status()), -1).ok();
  const LocalRegionEntry& entry = *served->entry;

  FdReply reply;
  reply.region = region_id;
  if (served->pinned) {
    // Never mapped, so never to revoke: the peer copies through this server (kCopy).
    reply.length = entry.length;
    reply.access = entry.access & served->exported.access;
    reply.flags = kFetchServedCopies;
    const absl::Status sent = Reply(socket, reply, -1);
    KVW_LOG(kDebug, "shm") << "region pinned by a device: served copies, not its memfd"
                           << Kv("peer", *peer) << Kv("region", region_id) << Kv("status", sent);
    return sent.ok();
  }
  reply.memfd_offset = served->memfd.offset;
  reply.length = entry.length;
  reply.access = entry.access & served->exported.access;
  reply.epoch_slot = served->memfd.epoch_slot;
  reply.epoch = served->memfd.epoch;
  // Without write permission the peer gets a read-only descriptor of the same memfd. That
  // alone would not stop it (it can reopen the descriptor read-write through /proc): the
  // memfd's F_SEAL_FUTURE_WRITE does (LocalRegionTable::Add).
  UniqueFd read_only;
  int fd = served->memfd.fd.get();
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
    const std::string path = absl::StrCat("/proc/self/fd/", fd);
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
