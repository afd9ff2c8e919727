// The target side of the tcp transport: an Asio acceptor on its own thread that also reads
// every connection's hello (no thread per unauthenticated connection) and watches the
// serving connections, and one ServerConnection per authenticated data connection, run by
// the transport's I/O pool (tcp_io_pool.h).
//
// Limits (TcpTransportOptions): connections open in total, connections in the hello stage in
// total and per remote address, authenticated connections per peer, an absolute deadline for
// the hello stage, and an I/O deadline on serving connections (a watchdog on the accept thread
// cuts a connection stuck inside one op, so that what it pinned is released).
#ifndef KVWIRE_TRANSPORT_TCP_TCP_SERVER_H_
#define KVWIRE_TRANSPORT_TCP_TCP_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "kvwire/stats.h"
#include "src/util/admission.h"
#include "src/util/mutex.h"
#include "src/util/recent_set.h"
#include "transport/tcp/tcp_server_connection.h"
#include "transport/tcp/tcp_staging.h"
#include "transport/tcp/tcp_transport.h"

namespace kvwire::transport {

// The data listener's limits at work (see TcpTransportOptions): what it refused and why.
struct TcpListenerStats {
  uint64_t connections = 0;         // data connections open now, every stage (gauge)
  uint64_t refused_over_limit = 0;  // refused by a connection limit (total, address, peer)
  uint64_t hello_refused = 0;       // bad hello or token not accepted
  uint64_t hello_timeouts = 0;      // hello stage not complete by its absolute deadline
  uint64_t thread_failures = 0;     // the I/O threads had stopped: refused
  uint64_t stalled_dropped = 0;     // cut mid-op by io_timeout; the peer was dropped
};

class TcpServer {
 public:
  // Listens on options.listen_host:listen_port and starts accepting.
  // Connections stage device memory with `staging` (its runtime is options.gpu_runtime).
  // Connections run on `pool`.
  static absl::StatusOr<std::unique_ptr<TcpServer>> Start(const TcpTransportOptions& options,
                                                          TargetHooks* hooks, GpuStaging staging,
                                                          std::shared_ptr<IoPool> pool);
  ~TcpServer();  // Shutdown()
  TcpServer(const TcpServer&) = delete;
  TcpServer& operator=(const TcpServer&) = delete;

  // "host:port" with the bound port.
  const std::string& endpoint() const { return endpoint_; }
  // Ends every incoming connection of `peer` and refuses its future ones.
  void DropPeer(PeerId peer);
  // Stops accepting, ends every connection, and joins every thread. Idempotent.
  void Shutdown();
  TcpListenerStats Stats() const;

 private:
  // A connection in the hello stage; owned by its pending handlers, on the accept thread.
  struct HelloStage;

  TcpServer(const TcpTransportOptions& options, TargetHooks* hooks, GpuStaging staging,
            std::shared_ptr<IoPool> pool);
  absl::Status Listen();
  void Accept();
  void OnAccepted(boost::asio::ip::tcp::socket socket);
  void ReadToken(const std::shared_ptr<HelloStage>& hello);
  // The token is in: serve the connection on the I/O pool, or refuse it.
  void Authenticate(const std::shared_ptr<HelloStage>& hello);
  // The hello stage of `hello` is over (whatever the outcome): it no longer counts as pending.
  void EndHelloStage(HelloStage& hello);
  // Cuts serving connections stuck in one access for longer than io_timeout, ends those
  // whose lingering after an error is over; reaps.
  void Watch();
  // Forgets connections that their I/O thread let go of.
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t ConnectionsOf(PeerId peer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TcpTransportOptions options_;
  TargetHooks* const hooks_;
  const GpuStaging staging_;
  const std::shared_ptr<IoPool> pool_;
  std::string endpoint_;  // set by Listen, read-only after Start

  // Used only by the accept thread after Start (and by Shutdown once that thread is joined).
  boost::asio::io_context io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_timer_;
  boost::asio::steady_timer watchdog_;
  absl::flat_hash_set<HelloStage*> hellos_;
  Admission admission_;  // counts hellos_ by remote address, and refuses past the limits
  std::thread accept_thread_;

  // Counters (TcpListenerStats).
  std::atomic<uint64_t> pending_{0};  // == hellos_.size(), readable from any thread
  std::atomic<uint64_t> refused_over_limit_{0};
  std::atomic<uint64_t> hello_refused_{0};
  std::atomic<uint64_t> hello_timeouts_{0};
  std::atomic<uint64_t> thread_failures_{0};
  std::atomic<uint64_t> stalled_dropped_{0};

  mutable Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<ServerConnection>> connections_ ABSL_GUARDED_BY(mu_);
  // Bounded: the engine revokes a peer's token before dropping it, so an old id is refused by
  // the token check already (peer ids are never reused).
  RecentSet<PeerId> dropped_ ABSL_GUARDED_BY(mu_){kClosedPeersRemembered};
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_SERVER_H_
