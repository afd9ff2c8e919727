// One incoming, authenticated data connection, target side, run by one thread of the transport's
// I/O pool (tcp_io_pool.h) on a non-blocking socket: answers the hello the server accepted,
// then serves ops as they arrive. Every op is validated by TargetHooks::ResolveIncoming (in
// AcceptOp, the one place an incoming op is checked) before memory is touched; WRITE payloads
// are received straight into the resolved memory and READ payloads sent straight from it;
// device memory (IncomingAccess::gpu_device >= 0) goes through pinned staging buffers
// (tcp_staging.h), blocking the connection's I/O thread while they run, and a WRITE into it
// is acknowledged (and counted as arrived) only after its last host->device copy ended. An
// invalid op or a malformed stream gets an error response, TargetHooks::OnPeerError, and the
// end of this connection (only).
#ifndef KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_
#define KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

#include "src/util/mutex.h"
#include "transport/tcp/tcp_io_pool.h"
#include "transport/tcp/tcp_read_run.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_staging.h"
#include "transport/transport.h"

namespace kvwire::transport {

class ServerConnection final : public IoHandler,
                               public std::enable_shared_from_this<ServerConnection> {
 public:
  // `socket` carries a hello the server already accepted for `peer` (TcpServer reads hellos
  // without a thread); this connection answers it and serves the peer's ops on a loop of
  // `pool`.
  ServerConnection(std::unique_ptr<Socket> socket, std::string remote, PeerId peer,
                   TargetHooks* hooks, uint64_t max_op_bytes, GpuStaging staging,
                   std::shared_ptr<IoPool> pool);
  ~ServerConnection() override;
  ServerConnection(const ServerConnection&) = delete;
  ServerConnection& operator=(const ServerConnection&) = delete;

  // Registers the connection with an I/O thread, which answers the hello and serves. Call
  // once, on a connection held by a shared_ptr. Unavailable when the pool stopped.
  absl::Status Start();
  // Ends the connection without reporting a peer error (DropPeer, Shutdown). Thread-safe.
  void Stop();
  // Ends a connection that stalled: its I/O thread drops what it pinned and reports `reason`
  // as the peer's error (the engine then drops the peer). True the first time. Thread-safe.
  bool Expire(std::string reason);
  // Waits (bounded) until the I/O thread let go of the connection; waits for nothing on a
  // thread of the I/O pool.
  void Join();
  bool Exited() const { return exited_.load(std::memory_order_acquire); }
  PeerId peer() const { return peer_; }
  const std::string& remote() const { return remote_; }
  // How long the connection has been inside one access that needs the peer to make
  // progress (receiving an op's payload, sending a batch of responses), and which one;
  // zero when it is not inside one (idle between ops holds no memory).
  absl::Duration BusyFor(std::chrono::steady_clock::time_point now, const char** what) const;
  // After an error response the connection drains input for a while (so that closing does
  // not reset the stream before the peer read the error); true once that time is over.
  bool LingerOver(std::chrono::steady_clock::time_point now) const;

  void OnIo(uint32_t events) override;

 private:
  class Responses;
  // Marks the connection busy with `what` for its scope, around the paths that block the I/O
  // thread (the outermost mark counts).
  class BusyScope;

  // One op the peer sent, validated and resolved.
  struct IncomingOp;

  // On the I/O thread: serves what the socket allows, then returns to epoll.
  void Pump();
  // Answers the hello (first turn only).
  absl::Status SendHelloReply();
  // Serves ops until the socket runs dry: reads an op's header, accepts it, serves it, and
  // sends the responses in batches. A non-OK result ends the stream; *refused: an error was
  // answered and the connection lingers; *more: stopped for fairness.
  absl::Status Serve(bool* more, bool* refused);
  // Sends the queued responses, as far as the socket takes them without waiting.
  absl::Status StartFlush();
  // Decodes and validates the op header at `raw` (sequence, region, bounds, permission,
  // memory kind) and announces its payload to the reader; nullopt when it was refused (the
  // error was answered and reported: the connection lingers, then ends), or with *parked
  // when its region is being moved (nothing answered: the same header is tried again).
  std::optional<IncomingOp> AcceptOp(const std::byte* raw, bool* parked);
  // Serves an accepted op: starts receiving a WRITE's payload, or queues a READ's with the
  // responses. An error ends the stream.
  absl::Status ServeOp(IncomingOp& op);
  // A WRITE into device memory: through the staging buffers (blocking), acked (and counted)
  // once the copies ended.
  absl::Status ReceiveStagedWrite(IncomingOp& op);
  // Marks the connection busy (or not) after its payload or flush state changed.
  void UpdateBusy(const char* what);
  // The stream ended (`io`): drops the pins, reports a stalled connection's expiry, and lets
  // go of the socket.
  void EndServing(const absl::Status& io);
  // Sends an error response (flushing the responses first), reports it, and starts to linger.
  void RefuseOp(uint64_t sequence, const absl::Status& error, const std::string& context);
  // Lingering: drops input until the peer closes, the time is over or enough was dropped.
  void DrainLinger();
  // Unregisters and closes the socket; the connection has exited. Idempotent.
  void Release();
  void Schedule();

  const std::unique_ptr<Socket> socket_;
  const std::string remote_;
  const PeerId peer_;
  TargetHooks* const hooks_;
  const uint64_t max_op_bytes_;
  const GpuStaging staging_;
  const std::shared_ptr<IoPool> pool_;
  const std::string context_;  // "tcp data connection from ... (peer ...)", for messages
  IoLoop* loop_ = nullptr;     // set by Start

  // I/O thread only.
  std::unique_ptr<Responses> responses_;
  std::unique_ptr<HeaderReader> reader_;
  uint64_t expected_seq_ = 0;
  bool hello_sent_ = false;
  bool released_ = false;
  bool lingering_ = false;
  uint64_t lingered_bytes_ = 0;
  // READs resolved ahead of their acceptance, as one run.
  ReadRun read_run_;
  // A WRITE whose payload is being received into host memory.
  std::unique_ptr<IncomingOp> receiving_;
  // The header of an op whose region is being moved (transport/region_moving.h): tried again
  // on the next turns, before any other input, until the move ends.
  std::optional<std::array<std::byte, 64>> parked_;
  size_t received_ = 0;

  // steady_clock nanoseconds since its epoch when the current access began; 0: none.
  std::atomic<int64_t> busy_since_ns_{0};
  std::atomic<const char*> busy_what_{""};
  // steady_clock nanoseconds when lingering ends; 0: not lingering.
  std::atomic<int64_t> linger_until_ns_{0};
  mutable Mutex mu_;
  CondVar exited_cv_;
  std::string expired_ ABSL_GUARDED_BY(mu_);  // why Expire cut the connection; "" if it did not
  bool scheduled_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopped_{false};
  std::atomic<bool> exited_{false};
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_SERVER_CONNECTION_H_
