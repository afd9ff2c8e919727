#include "transport/tcp/tcp_server.h"

#include <chrono>
#include <pthread.h>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/log.h"
#include "transport/tcp/tcp_socket.h"

namespace kvwire::transport {
namespace asio = boost::asio;

namespace {
// How long DropPeer waits for the peer's connections to leave an access in progress; they
// were shut down, so a receive or send into region memory ends at once.
constexpr absl::Duration kDropPeerWait = absl::Seconds(2);
}  // namespace
using asio::ip::tcp;

absl::StatusOr<std::unique_ptr<TcpServer>> TcpServer::Start(const TcpTransportOptions& options,
                                                            TargetHooks* hooks,
                                                            GpuStaging staging) {
  std::unique_ptr<TcpServer> server(new TcpServer(options, hooks, std::move(staging)));
  if (absl::Status s = server->Listen(); !s.ok()) return s;
  server->Accept();
  server->accept_thread_ = std::thread([s = server.get()] {
    pthread_setname_np(pthread_self(), "kvw-tcp-accept");
    s->io_.run();
  });
  return server;
}

TcpServer::TcpServer(const TcpTransportOptions& options, TargetHooks* hooks, GpuStaging staging)
    : options_(options),
      hooks_(hooks),
      staging_(std::move(staging)),
      acceptor_(io_),
      retry_timer_(io_) {}

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
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted) return;
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
  const std::string remote_text =
      ec ? std::string("unknown") : FormatEndpoint(remote.address().to_string(), remote.port());
  absl::Status configured = ConfigureSocket(socket.native_handle(), options_.socket_buffer_bytes);
  // The connection does blocking I/O on the descriptor.
  if (configured.ok()) {
    socket.native_non_blocking(false, ec);
    if (ec) configured = absl::InternalError(ec.message());
  }
  if (!configured.ok()) {
    KVW_LOG(kWarning, "tcp") << "cannot set up accepted connection" << Kv("remote", remote_text)
                             << Kv("error", configured.message());
    return;  // `socket` closes
  }
  const int fd = socket.release(ec);
  if (ec) return;
  auto connection = std::make_unique<ServerConnection>(
      std::make_unique<Socket>(fd), remote_text, hooks_, options_.max_op_bytes, staging_,
      [this](ServerConnection* c, PeerId peer) { return Admit(c, peer); });
  MutexLock lock(&mu_);
  if (stopped_) return;  // the connection closes its socket on destruction
  Reap();
  connection->Start();
  connections_.push_back(std::move(connection));
}

bool TcpServer::Admit(ServerConnection* connection, PeerId peer) {
  MutexLock lock(&mu_);
  if (stopped_ || dropped_.contains(peer)) return false;
  connection->set_peer(peer);
  return true;
}

void TcpServer::Reap() {
  for (size_t i = 0; i < connections_.size();) {
    if (connections_[i]->Exited()) {
      connections_[i]->Join();
      connections_[i] = std::move(connections_.back());
      connections_.pop_back();
    } else {
      ++i;
    }
  }
}

void TcpServer::DropPeer(PeerId peer) {
  MutexLock lock(&mu_);
  dropped_.insert(peer);
  std::vector<ServerConnection*> stopping;
  for (const std::unique_ptr<ServerConnection>& connection : connections_) {
    if (connection->peer() == peer) {
      connection->Stop();
      stopping.push_back(connection.get());
    }
  }
  // The engine reports the peer closed when this returns, and its owner may then reuse the
  // memory the peer was reading or writing: wait (bounded) until no connection of the peer
  // is inside an access any more. Serving threads never need mu_ (only Admit, during the
  // handshake, does), so waiting under it cannot deadlock.
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
  io_.stop();
  if (accept_thread_.joinable()) accept_thread_.join();
  boost::system::error_code ec;
  acceptor_.close(ec);
  std::vector<std::unique_ptr<ServerConnection>> connections;
  {
    MutexLock lock(&mu_);
    connections.swap(connections_);
  }
  for (const std::unique_ptr<ServerConnection>& connection : connections) connection->Stop();
  for (const std::unique_ptr<ServerConnection>& connection : connections) connection->Join();
  KVW_LOG(kInfo, "tcp") << "server stopped" << Kv("endpoint", endpoint_);
}

}  // namespace kvwire::transport
