// One incoming, authenticated data connection, target side: answers the hello the server
// accepted, then serves ops on one thread. Every op is validated by TargetHooks::ResolveIncoming
// before memory is touched; WRITE payloads are received straight into the resolved memory and READ
// payloads sent straight from it; device memory (IncomingAccess::gpu_device >= 0) goes through
// pinned staging buffers (tcp_staging.h), and a WRITE into it is acknowledged (and counted as
// arrived) only after its last host->device copy ended. An invalid op or a malformed stream
// gets an error response, TargetHooks::OnPeerError, and the end of this connection (only).
#ifndef KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_
#define KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_staging.h"
#include "transport/transport.h"

namespace kvwire::transport {

class ServerConnection {
 public:
  // `socket` carries a hello the server already accepted for `peer` (TcpServer reads hellos
  // without a thread); this connection answers it and serves the peer's ops.
  ServerConnection(std::unique_ptr<Socket> socket, std::string remote, PeerId peer,
                   TargetHooks* hooks, uint64_t max_op_bytes, GpuStaging staging);
  // Stops and joins.
  ~ServerConnection();
  ServerConnection(const ServerConnection&) = delete;
  ServerConnection& operator=(const ServerConnection&) = delete;

  // Starts the serving thread; ResourceExhausted (nothing started) when the system has no
  // thread to give.
  absl::Status Start();
  // Ends the connection without reporting a peer error (DropPeer, Shutdown). Thread-safe.
  void Stop();
  // Ends a connection that stalled: its thread drops what it pinned and reports `reason` as
  // the peer's error (the engine then drops the peer). True the first time. Thread-safe.
  bool Expire(std::string reason);
  void Join();
  bool Exited() const { return exited_.load(std::memory_order_acquire); }
  PeerId peer() const { return peer_; }
  const std::string& remote() const { return remote_; }
  // How long the serving thread has been inside one access that needs the peer to make
  // progress (receiving an op's payload, sending a batch of responses), and which one;
  // zero when it is not inside one (idle between ops holds no memory).
  absl::Duration BusyFor(std::chrono::steady_clock::time_point now, const char** what) const;

 private:
  class Responses;
  // Marks the serving thread busy with `what` for its scope (the outermost mark counts).
  class BusyScope;

  // One op the peer sent, validated and resolved.
  struct IncomingOp;

  void Run();
  // Serves ops until the stream ends or an error was answered: reads an op's header, accepts
  // it, serves it, and sends the responses in batches.
  void Serve();
  // Decodes and validates the op header at `raw` (sequence, region, bounds, permission,
  // memory kind) and announces its payload to `reader`; nullopt when it was refused (the
  // error was answered and reported: the connection ends).
  std::optional<IncomingOp> AcceptOp(const std::byte* raw, uint64_t& expected_seq,
                                     HeaderReader& reader, Responses& responses,
                                     const std::string& context);
  // Serves an accepted op: receives a WRITE's payload, or queues a READ's with the
  // responses. An error ends the stream.
  absl::Status ServeOp(IncomingOp& op, HeaderReader& reader, Responses& responses);
  // A WRITE into host memory: straight into it, acked (and counted) at once.
  absl::Status ReceiveWrite(IncomingOp& op, HeaderReader& reader, Responses& responses);
  // A WRITE into device memory: through the staging buffers, acked (and counted) once the
  // copies ended.
  absl::Status ReceiveStagedWrite(IncomingOp& op, HeaderReader& reader, Responses& responses);
  // The stream ended (`io`): drops the pins, and reports a stalled connection's expiry.
  void EndServing(Responses& responses, const absl::Status& io, const std::string& context);
  // Sends an error response (flushing `responses` first), reports it, and returns.
  void RefuseOp(Responses& responses, uint64_t sequence, const absl::Status& error,
                const std::string& context);
  // After an error response: stop sending, and discard input for a moment so that closing
  // does not reset the connection before the peer read the error.
  void Linger();

  const std::unique_ptr<Socket> socket_;
  const std::string remote_;
  const PeerId peer_;
  TargetHooks* const hooks_;
  const uint64_t max_op_bytes_;
  const GpuStaging staging_;

  // steady_clock nanoseconds since its epoch when the current access began; 0: none.
  std::atomic<int64_t> busy_since_ns_{0};
  std::atomic<const char*> busy_what_{""};
  mutable Mutex mu_;
  std::string expired_ ABSL_GUARDED_BY(mu_);  // why Expire cut the connection; "" if it did not
  std::atomic<bool> stopped_{false};
  std::atomic<bool> exited_{false};
  std::thread thread_;  // started by Start, joined by Join (both on the server's threads)
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_
