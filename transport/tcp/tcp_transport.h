// tcp transport: one-sided READ/WRITE emulated over plain TCP sockets: every data connection is
// a non-blocking socket run by one of a fixed set of I/O threads (epoll, tcp_io_pool.h) with
// scatter/gather sendmsg/recvmsg (tcp_client_connection.h, tcp_server_connection.h), so the
// transport's threads do not grow with its peers; Boost.Asio only accepts and dials the
// connections and reads the hello of unauthenticated ones, on one more thread (tcp_server.h). The
// target validates every op (TargetHooks::ResolveIncoming) before touching memory. With a GPU
// runtime, ops on device memory (either side) are staged through pinned host buffers.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define KVWIRE_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/gpu/runtime.h"
#include "transport/transport.h"

namespace kvwire::transport {

struct TcpTransportOptions {
  // The runtime of kGpu regions (the engine's); null: GPU memory is refused
  // (caps().gpu_memory is false).
  gpu::Runtime* gpu_runtime = nullptr;
  // Data listener address; port 0 picks a free one. The host is what peers dial.
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  uint32_t max_lanes = 16;
  // I/O threads that run every data connection, both directions (TcpOptions::io_threads);
  // 0 = IoPool::DefaultThreads() (1 per 8 cores, 1..4).
  uint32_t io_threads = 0;
  // How long an I/O thread keeps polling its sockets after its last event before it sleeps
  // (TcpOptions::io_poll; tcp_io_pool.h says why); zero: it sleeps at once. Costs CPU
  // only while data moves, never on an idle transport.
  absl::Duration io_poll = absl::Microseconds(20);
  // How the I/O threads wait for readiness (TcpOptions::io_backend): "epoll", "io_uring"
  // (refused where io_uring_queue_init fails) or "auto" (io_uring where it works, else epoll,
  // logging why once).
  std::string io_backend = "epoll";
  // Data connections a Channel opens to one peer (Capabilities::lanes_per_peer; at most
  // max_lanes): TcpOptions::connections.
  uint32_t connections_per_peer = 4;
  uint64_t max_op_bytes = 1 << 20;
  // Socket buffer sizes (0 = kernel default).
  int socket_buffer_bytes = 4 << 20;

  // Limits of the data listener. Whatever a dialer sends, it holds at most one socket and no
  // thread until its session token is accepted, and a serving thread only after that. Every
  // refusal is logged with its reason, counted (TcpTransportStats, group "tcp_listener"), and
  // answered with a hello reply that names the limit when the socket can still take it. Data
  // connections open at once, in every stage.
  uint32_t max_data_connections = 1024;
  // Connections in the hello stage (no accepted token yet), in total and per remote address.
  uint32_t max_pending_hellos = 128;
  uint32_t max_pending_hellos_per_address = 32;
  // Authenticated connections of one peer.
  uint32_t max_data_connections_per_peer = 64;
  // Absolute deadline for the whole hello stage (hello header and token) of a connection.
  absl::Duration hello_timeout = absl::Seconds(10);
  // An authenticated connection that takes longer than this to receive one op's payload, or
  // to send one batch of responses, is cut and its peer dropped: the memory it pinned is
  // released. Keep it below the 10 s that DeregisterMemory waits for ops in flight.
  absl::Duration io_timeout = absl::Seconds(5);
};

// The statistics the tcp transport reports (groups "gpu" and "tcp_listener"), at zero.
std::vector<TransportStat> TcpTransportStats();

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TcpTransportOptions& options,
                                                              TargetHooks* hooks);

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_TRANSPORT_H_
