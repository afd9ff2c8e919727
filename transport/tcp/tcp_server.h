// The target side of the tcp transport: an Asio acceptor on its own thread, and one
// ServerConnection (one thread) per incoming data connection.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_SERVER_H_
#define KVWIRE_TRANSPORT_TCP_TCP_SERVER_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"

#include "src/util/mutex.h"
#include "transport/tcp/tcp_server_connection.h"
#include "transport/tcp/tcp_staging.h"
#include "transport/tcp/tcp_transport.h"

namespace kvwire::transport {

class TcpServer {
 public:
  // Listens on options.listen_host:listen_port and starts accepting.
  // Connections stage device memory with `staging` (its runtime is options.gpu_runtime).
  static absl::StatusOr<std::unique_ptr<TcpServer>> Start(const TcpTransportOptions& options,
                                                          TargetHooks* hooks, GpuStaging staging);
  ~TcpServer();  // Shutdown()
  TcpServer(const TcpServer&) = delete;
  TcpServer& operator=(const TcpServer&) = delete;

  // "host:port" with the bound port.
  const std::string& endpoint() const { return endpoint_; }
  // Ends every incoming connection of `peer` and refuses its future ones.
  void DropPeer(PeerId peer);
  // Stops accepting, ends every connection, and joins every thread. Idempotent.
  void Shutdown();

 private:
  TcpServer(const TcpTransportOptions& options, TargetHooks* hooks, GpuStaging staging);
  absl::Status Listen();
  void Accept();
  void OnAccepted(boost::asio::ip::tcp::socket socket);
  bool Admit(ServerConnection* connection, PeerId peer);
  // Joins and forgets connections whose thread has returned.
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TcpTransportOptions options_;
  TargetHooks* const hooks_;
  const GpuStaging staging_;
  std::string endpoint_;  // set by Listen, read-only after Start

  // Used only by the accept thread after Start (and by Shutdown once that thread is joined).
  boost::asio::io_context io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_timer_;
  std::thread accept_thread_;

  Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<ServerConnection>> connections_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<PeerId> dropped_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_SERVER_H_
