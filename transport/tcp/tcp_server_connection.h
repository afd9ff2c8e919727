// One incoming data connection, target side: checks the hello (session token), then serves
// ops on one thread. Every op is validated by TargetHooks::ResolveIncoming before memory is
// touched; WRITE payloads are received straight into the resolved memory and READ payloads
// sent straight from it; device memory (IncomingAccess::gpu_device >= 0) goes through pinned
// staging buffers (tcp_staging.h), and a WRITE into it is acknowledged (and counted as
// arrived) only after its last host->device copy ended. An invalid op or a malformed stream
// gets an error response, TargetHooks::OnPeerError, and the end of this connection (only).
#ifndef KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_
#define KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"

#include "src/util/mutex.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_staging.h"
#include "transport/transport.h"

namespace kvwire::transport {

class ServerConnection {
 public:
  // Whether a peer that just authenticated may be served (false once it was dropped). On
  // true it must have called set_peer, under the same lock that DropPeer takes, so that a
  // drop cannot slip between the check and the record.
  using AdmitFn = std::function<bool(ServerConnection*, PeerId)>;

  ServerConnection(std::unique_ptr<Socket> socket, std::string remote, TargetHooks* hooks,
                   uint64_t max_op_bytes, GpuStaging staging, AdmitFn admit);
  // Stops and joins.
  ~ServerConnection();
  ServerConnection(const ServerConnection&) = delete;
  ServerConnection& operator=(const ServerConnection&) = delete;

  void Start();
  // Ends the connection without reporting a peer error (DropPeer, Shutdown). Thread-safe.
  void Stop();
  void Join();
  bool Exited() const { return exited_.load(std::memory_order_acquire); }
  // The authenticated peer, once the hello was accepted.
  std::optional<PeerId> peer() const;
  void set_peer(PeerId peer);

 private:
  class Responses;

  void Run();
  // Reads the hello and answers it; the peer on success.
  absl::StatusOr<PeerId> Handshake();
  // Serves ops until the stream ends or an error was answered.
  void Serve(PeerId peer);
  // Sends an error response (flushing `responses` first), reports it, and returns.
  void RefuseOp(PeerId peer, Responses& responses, uint64_t sequence, const absl::Status& error,
                const std::string& context);
  // After an error response: stop sending, and discard input for a moment so that closing
  // does not reset the connection before the peer read the error.
  void Linger();

  const std::unique_ptr<Socket> socket_;
  const std::string remote_;
  TargetHooks* const hooks_;
  const uint64_t max_op_bytes_;
  const GpuStaging staging_;
  const AdmitFn admit_;

  mutable Mutex mu_;
  std::optional<PeerId> peer_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopped_{false};
  std::atomic<bool> exited_{false};
  std::thread thread_;  // started by Start, joined by Join (both on the server's threads)
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_
