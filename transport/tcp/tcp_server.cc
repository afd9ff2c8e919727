#include "transport/tcp/tcp_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <exception>
#include <pthread.h>
#include <system_error>
#include <utility>
#include <vector>

#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/log.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace asio = boost::asio;
namespace wire = tcp_wire;
using asio::ip::tcp;

namespace {

// How long DropPeer waits for the peer's connections to leave an access in progress; they
// were shut down, so a receive or send into region memory ends at once.
constexpr absl::Duration kDropPeerWait = absl::Seconds(2);

// A flood refuses thousands of connections: log the first ones, then every 1000th.
bool ShouldLog(uint64_t count) { return count <= 10 || count % 1000 == 0; }

std::chrono::nanoseconds ToChrono(absl::Duration d) {
  return std::chrono::nanoseconds(absl::ToInt64Nanoseconds(d));
}

// Answers a refused dialer with a hello reply naming `error` and ends the stream; the caller
// closes the descriptor. Never blocks the accept thread: a reply that does not fit into the
// socket buffer at once is not sent (on a connection that sent at most a hello, it fits).
void SendRefusal(int fd, const absl::Status& error) {
  std::string message(error.message());
  message.resize(std::min<size_t>(message.size(), wire::kMaxMessageBytes));
  wire::HelloReply reply;
  reply.code = static_cast<uint32_t>(error.code());
  reply.message_len = static_cast<uint32_t>(message.size());
  std::array<std::byte, wire::kHelloReplyBytes + wire::kMaxMessageBytes> out;
  wire::EncodeHelloReply(reply, out.data());
  std::memcpy(out.data() + wire::kHelloReplyBytes, message.data(), message.size());
  (void)::send(fd, out.data(), wire::kHelloReplyBytes + message.size(),
               MSG_DONTWAIT | MSG_NOSIGNAL);
  ::shutdown(fd, SHUT_WR);
}

}  // namespace

struct TcpServer::HelloStage {
  HelloStage(asio::io_context& io, tcp::socket s, std::string remote_text, std::string address_text)
      : socket(std::move(s)),
        deadline(io),
        remote(std::move(remote_text)),
        address(std::move(address_text)) {}

  tcp::socket socket;
  asio::steady_timer deadline;
  const std::string remote;   // "host:port", for messages
  const std::string address;  // "host": what the per-address limit counts
  std::array<std::byte, wire::kHelloBytes> header;
  std::string token;
  bool ended = false;  // EndHelloStage ran
};

absl::StatusOr<std::unique_ptr<TcpServer>> TcpServer::Start(const TcpTransportOptions& options,
                                                            TargetHooks* hooks, GpuStaging staging,
                                                            std::shared_ptr<IoPool> pool) {
  std::unique_ptr<TcpServer> server(
      new TcpServer(options, hooks, std::move(staging), std::move(pool)));
  if (absl::Status s = server->Listen(); !s.ok()) return s;
  server->Accept();
  server->Watch();
  try {
    server->accept_thread_ = std::thread([s = server.get()] {
      pthread_setname_np(pthread_self(), "kvw-tcp-accept");
      // Handlers report errors as values; should one throw anyway (bad_alloc), the listener
      // logs it and goes on rather than take the process down.
      while (true) {
        try {
          s->io_.run();
          return;
        } catch (const std::exception& e) {
          KVW_LOG(kError, "tcp") << "listener handler failed; listener continues"
                                 << Kv("endpoint", s->endpoint_) << Kv("error", e.what());
        }
      }
    });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat("tcp listener on ", server->endpoint_,
                                                     ": cannot start its thread: ", e.what()));
  }
  return server;
}

TcpServer::TcpServer(const TcpTransportOptions& options, TargetHooks* hooks, GpuStaging staging,
                     std::shared_ptr<IoPool> pool)
    : options_(options),
      hooks_(hooks),
      staging_(std::move(staging)),
      pool_(std::move(pool)),
      acceptor_(io_),
      retry_timer_(io_),
      watchdog_(io_),
      admission_(Admission::Limits{.max_pending = options.max_pending_hellos,
                                   .max_pending_per_source = options.max_pending_hellos_per_address,
                                   .max_open = options.max_data_connections}) {}

TcpServer::~TcpServer() { Shutdown(); }

absl::Status TcpServer::Listen() {
  const std::string where = FormatEndpoint(options_.listen_host, options_.listen_port);
  boost::system::error_code ec;
  const asio::ip::address address = asio::ip::make_address(options_.listen_host, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp listen address ", where, ": not an IP address: ", ec.message()));
  }
  const tcp::endpoint local(address, options_.listen_port);
  acceptor_.open(local.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (ec) return absl::InternalError(absl::StrCat("tcp listen on ", where, ": ", ec.message()));
  // Accepted sockets inherit the buffer sizes, and the window scale is chosen at SYN time.
  if (absl::Status s = ConfigureSocket(acceptor_.native_handle(), options_.socket_buffer_bytes);
      !s.ok()) {
    return absl::InternalError(absl::StrCat("tcp listen on ", where, ": ", s.message()));
  }
  acceptor_.bind(local, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("tcp listen on ", where, ": ", ec.message()));
  const tcp::endpoint bound = acceptor_.local_endpoint(ec);
  if (ec) return absl::InternalError(absl::StrCat("tcp listen on ", where, ": ", ec.message()));
  endpoint_ = FormatEndpoint(options_.listen_host, bound.port());
  KVW_LOG(kInfo, "tcp") << "listening" << Kv("endpoint", endpoint_);
  return absl::OkStatus();
}

void TcpServer::Accept() {
  if (!acceptor_.is_open()) return;  // Shutdown closed it
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) {
      // E.g. out of descriptors: try again shortly rather than spin.
      KVW_LOG(kWarning, "tcp") << "accept failed" << Kv("endpoint", endpoint_)
                               << Kv("error", ec.message());
      retry_timer_.expires_after(std::chrono::milliseconds(100));
      retry_timer_.async_wait([this](const boost::system::error_code& e) {
        if (!e) Accept();
      });
      return;
    }
    OnAccepted(std::move(socket));
    Accept();
  });
}

void TcpServer::OnAccepted(tcp::socket socket) {
  boost::system::error_code ec;
  const tcp::endpoint remote = socket.remote_endpoint(ec);
  const std::string address = ec ? std::string("unknown") : remote.address().to_string();
  const std::string remote_text = ec ? address : FormatEndpoint(address, remote.port());

  size_t open = 0;
  {
    MutexLock lock(&mu_);
    if (stopped_) return;  // `socket` closes
    Reap();
    open = hellos_.size() + connections_.size();
  }
  absl::Status refused;
  switch (admission_.Check(address, open)) {
    case Admission::Refusal::kNone:
      break;
    case Admission::Refusal::kPending:
      refused = absl::ResourceExhaustedError(
          absl::StrCat("tcp data port ", endpoint_, ": ", admission_.pending(),
                       " connections are in the hello stage, the limit (tcp.max_pending_hellos ",
                       options_.max_pending_hellos, ") is reached"));
      break;
    case Admission::Refusal::kPendingFromSource:
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "tcp data port ", endpoint_, ": ", admission_.pending_from(address), " connections from ",
          address, " are in the hello stage, the limit (tcp.max_pending_hellos_per_address ",
          options_.max_pending_hellos_per_address, ") is reached"));
      break;
    case Admission::Refusal::kOpen:
      refused = absl::ResourceExhaustedError(
          absl::StrCat("tcp data port ", endpoint_, ": ", open,
                       " connections are open, the limit (tcp.max_data_connections ",
                       options_.max_data_connections, ") is reached"));
      break;
  }
  if (!refused.ok()) {
    const uint64_t n = ++refused_over_limit_;
    if (ShouldLog(n)) {
      KVW_LOG(kWarning, "tcp") << "data connection refused" << Kv("remote", remote_text)
                               << Kv("reason", refused.message()) << Kv("refused_over_limit", n);
    }
    SendRefusal(socket.native_handle(), refused);
    return;  // `socket` closes
  }
  if (absl::Status s = ConfigureSocket(socket.native_handle(), options_.socket_buffer_bytes);
      !s.ok()) {
    KVW_LOG(kWarning, "tcp") << "cannot set up accepted connection" << Kv("remote", remote_text)
                             << Kv("error", s.message());
    return;
  }

  auto hello = std::make_shared<HelloStage>(io_, std::move(socket), remote_text, address);
  hellos_.insert(hello.get());
  admission_.BeginPending(address);
  pending_.store(hellos_.size(), std::memory_order_relaxed);
  // Absolute: however slowly the bytes trickle in, the stage ends here.
  hello->deadline.expires_after(ToChrono(options_.hello_timeout));
  hello->deadline.async_wait([this, hello](const boost::system::error_code& e) {
    if (e || hello->ended) return;
    const uint64_t n = ++hello_timeouts_;
    if (ShouldLog(n)) {
      KVW_LOG(kWarning, "tcp") << "data connection refused" << Kv("remote", hello->remote)
                               << Kv("reason",
                                     absl::StrCat("hello not complete within ",
                                                  absl::FormatDuration(options_.hello_timeout),
                                                  " (absolute deadline)"))
                               << Kv("hello_timeouts", n);
    }
    EndHelloStage(*hello);
    boost::system::error_code ignored;
    hello->socket.close(ignored);  // the pending read ends with operation_aborted
  });
  asio::async_read(hello->socket, asio::buffer(hello->header),
                   [this, hello](const boost::system::error_code& e, size_t) {
                     if (hello->ended) return;
                     if (e) {
                       KVW_LOG(kInfo, "tcp")
                           << "data connection closed before its hello"
                           << Kv("remote", hello->remote) << Kv("error", e.message());
                       EndHelloStage(*hello);
                       hello->deadline.cancel();
                       return;
                     }
                     wire::Hello h;
                     absl::Status check = wire::DecodeHello(hello->header.data(), &h);
                     if (check.ok() && h.version != wire::kVersion) {
                       check = absl::FailedPreconditionError(absl::StrCat(
                           "tcp wire protocol version ", h.version,
                           " is not supported (this side speaks ", wire::kVersion, ")"));
                     }
                     if (!check.ok()) {
                       const uint64_t n = ++hello_refused_;
                       if (ShouldLog(n)) {
                         KVW_LOG(kWarning, "tcp")
                             << "data connection refused" << Kv("remote", hello->remote)
                             << Kv("reason", check.message()) << Kv("hello_refused", n);
                       }
                       EndHelloStage(*hello);
                       hello->deadline.cancel();
                       SendRefusal(hello->socket.native_handle(), check);
                       return;  // the last handler lets go of `hello`: the socket closes
                     }
                     hello->token.resize(h.token_len);
                     ReadToken(hello);
                   });
}

void TcpServer::ReadToken(const std::shared_ptr<HelloStage>& hello) {
  asio::async_read(hello->socket, asio::buffer(hello->token),
                   [this, hello](const boost::system::error_code& e, size_t) {
                     if (hello->ended) return;
                     if (e) {
                       KVW_LOG(kInfo, "tcp")
                           << "data connection closed in its hello" << Kv("remote", hello->remote)
                           << Kv("error", e.message());
                       EndHelloStage(*hello);
                       hello->deadline.cancel();
                       return;
                     }
                     Authenticate(hello);
                   });
}

void TcpServer::Authenticate(const std::shared_ptr<HelloStage>& hello) {
  EndHelloStage(*hello);
  hello->deadline.cancel();
  const int fd = hello->socket.native_handle();
  absl::StatusOr<PeerId> peer = hooks_->PeerForToken(hello->token);
  if (!peer.ok()) {
    // Whatever the engine's reason, the dialer learns that its token was not accepted.
    const absl::Status refused = absl::UnauthenticatedError(peer.status().message());
    const uint64_t n = ++hello_refused_;
    if (ShouldLog(n)) {
      KVW_LOG(kWarning, "tcp") << "data connection refused" << Kv("remote", hello->remote)
                               << Kv("reason", refused.message()) << Kv("hello_refused", n);
    }
    SendRefusal(fd, refused);
    return;
  }
  // The I/O pool runs the descriptor from here on (non-blocking).
  boost::system::error_code ec;
  hello->socket.release(ec);
  if (ec) {
    KVW_LOG(kWarning, "tcp") << "cannot set up accepted connection" << Kv("remote", hello->remote)
                             << Kv("error", ec.message());
    return;
  }
  auto socket = std::make_unique<Socket>(fd);

  MutexLock lock(&mu_);
  absl::Status refused;
  std::atomic<uint64_t>* counter = &hello_refused_;
  if (stopped_) {
    refused = absl::UnavailableError("tcp target is shutting down");
  } else if (dropped_.Contains(*peer)) {
    refused = absl::UnauthenticatedError(absl::StrCat("peer ", *peer, " was dropped"));
  } else if (const size_t open = ConnectionsOf(*peer);
             open >= options_.max_data_connections_per_peer) {
    refused = absl::ResourceExhaustedError(
        absl::StrCat("peer ", *peer, " has ", open,
                     " data connections open, the limit (tcp.max_data_connections_per_peer ",
                     options_.max_data_connections_per_peer, ") is reached"));
    counter = &refused_over_limit_;
  } else {
    auto connection = std::make_shared<ServerConnection>(
        std::move(socket), hello->remote, *peer, hooks_, options_.max_op_bytes, staging_, pool_);
    refused = connection->Start();
    if (refused.ok()) {
      connections_.push_back(std::move(connection));
      return;
    }
    counter = &thread_failures_;
    // `connection` closes the descriptor when it goes, after the refusal below.
    const uint64_t n = ++*counter;
    KVW_LOG(kError, "tcp") << "data connection refused" << Kv("remote", hello->remote)
                           << Kv("peer", *peer) << Kv("reason", refused.message())
                           << Kv("thread_failures", n);
    SendRefusal(fd, refused);
    return;
  }
  const uint64_t n = ++*counter;
  if (ShouldLog(n)) {
    KVW_LOG(kWarning, "tcp") << "data connection refused" << Kv("remote", hello->remote)
                             << Kv("peer", *peer) << Kv("reason", refused.message());
  }
  SendRefusal(fd, refused);
}

void TcpServer::EndHelloStage(HelloStage& hello) {
  if (hello.ended) return;
  hello.ended = true;
  hellos_.erase(&hello);
  admission_.EndPending(hello.address);
  pending_.store(hellos_.size(), std::memory_order_relaxed);
}

void TcpServer::Watch() {
  const absl::Duration period =
      std::clamp(options_.io_timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
  watchdog_.expires_after(ToChrono(period));
  watchdog_.async_wait([this](const boost::system::error_code& e) {
    if (e) return;
    const auto now = std::chrono::steady_clock::now();
    {
      MutexLock lock(&mu_);
      if (stopped_) return;
      Reap();
      for (const std::shared_ptr<ServerConnection>& connection : connections_) {
        if (connection->LingerOver(now)) connection->Stop();
        const char* what = "";
        const absl::Duration busy = connection->BusyFor(now, &what);
        if (busy <= options_.io_timeout) continue;
        std::string reason =
            absl::StrCat("stalled for ", absl::FormatDuration(busy), " ", what, " (io_timeout ",
                         absl::FormatDuration(options_.io_timeout), ")");
        if (connection->Expire(reason)) {
          const uint64_t n = ++stalled_dropped_;
          KVW_LOG(kWarning, "tcp")
              << "cutting stalled data connection" << Kv("remote", connection->remote())
              << Kv("peer", connection->peer()) << Kv("reason", reason) << Kv("stalled_dropped", n);
        }
      }
    }
    Watch();
  });
}

void TcpServer::Reap() {
  for (size_t i = 0; i < connections_.size();) {
    if (connections_[i]->Exited()) {
      connections_[i] = std::move(connections_.back());
      connections_.pop_back();
    } else {
      ++i;
    }
  }
}

size_t TcpServer::ConnectionsOf(PeerId peer) const {
  size_t n = 0;
  for (const std::shared_ptr<ServerConnection>& connection : connections_) {
    if (connection->peer() == peer && !connection->Exited()) ++n;
  }
  return n;
}

TcpListenerStats TcpServer::Stats() const {
  TcpListenerStats s;
  s.connections = pending_.load(std::memory_order_relaxed);
  {
    MutexLock lock(&mu_);
    for (const std::shared_ptr<ServerConnection>& connection : connections_) {
      if (!connection->Exited()) ++s.connections;
    }
  }
  s.refused_over_limit = refused_over_limit_.load(std::memory_order_relaxed);
  s.hello_refused = hello_refused_.load(std::memory_order_relaxed);
  s.hello_timeouts = hello_timeouts_.load(std::memory_order_relaxed);
  s.thread_failures = thread_failures_.load(std::memory_order_relaxed);
  s.stalled_dropped = stalled_dropped_.load(std::memory_order_relaxed);
  return s;
}

void TcpServer::DropPeer(PeerId peer) {
  MutexLock lock(&mu_);
  dropped_.Insert(peer);
  std::vector<ServerConnection*> stopping;
  for (const std::shared_ptr<ServerConnection>& connection : connections_) {
    if (connection->peer() == peer) {
      connection->Stop();
      stopping.push_back(connection.get());
    }
  }
  // The engine reports the peer closed when this returns, and its owner may then reuse the
  // memory the peer was reading or writing: wait (bounded) until no connection of the peer
  // is inside an access any more. I/O threads never need mu_, so waiting under it cannot
  // deadlock. On an I/O thread (a callback) there is no waiting: that thread may be the one
  // the connection needs, and a stopped connection touches no memory on its next turn.
  if (pool_->OnPoolThread()) return;
  const absl::Time deadline = absl::Now() + kDropPeerWait;
  for (ServerConnection* connection : stopping) {
    while (!connection->Exited() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    if (!connection->Exited()) {
      KVW_LOG(kWarning, "tcp") << "connection of a dropped peer still busy" << Kv("peer", peer);
    }
  }
}

void TcpServer::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  // Everything that keeps io_ busy ends on its own thread; run() returns once the handlers
  // of the cancelled operations ran (they start nothing new once stopped_ is set).
  auto close_all = [this] {
    boost::system::error_code ec;
    acceptor_.close(ec);
    retry_timer_.cancel();
    watchdog_.cancel();
    for (HelloStage* hello : std::vector<HelloStage*>(hellos_.begin(), hellos_.end())) {
      hello->deadline.cancel();
      hello->socket.close(ec);
    }
  };
  if (accept_thread_.joinable()) {
    asio::post(io_, close_all);
    accept_thread_.join();
  } else {
    close_all();
  }
  std::vector<std::shared_ptr<ServerConnection>> connections;
  {
    MutexLock lock(&mu_);
    connections.swap(connections_);
  }
  for (const std::shared_ptr<ServerConnection>& connection : connections) connection->Stop();
  for (const std::shared_ptr<ServerConnection>& connection : connections) connection->Join();
  KVW_LOG(kInfo, "tcp") << "server stopped" << Kv("endpoint", endpoint_);
}

}  // namespace kvwire::transport
