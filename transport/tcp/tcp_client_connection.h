// One data connection of a tcp channel, initiator side, run by one thread of the transport's
// I/O pool (tcp_io_pool.h) on a non-blocking socket: it sends op headers and WRITE payloads
// with gather I/O, many ops pipelined without waiting for responses, and receives the
// responses in order (READ data straight into local memory) and completes the requests, all
// on that thread; Post and Close hand work to it from any thread. Device memory
// (WireOp::local_gpu_device >= 0) goes through pinned staging buffers instead
// (tcp_staging.h); those copies block the connection's I/O thread while they run.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_CLIENT_CONNECTION_H_
#define KVWIRE_TRANSPORT_TCP_TCP_CLIENT_CONNECTION_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"

#include "src/util/mutex.h"
#include "transport/tcp/tcp_gather.h"
#include "transport/tcp/tcp_io_pool.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_staging.h"
#include "transport/tcp/tcp_wire.h"
#include "transport/transport.h"

namespace kvwire::transport {

class ClientConnection final : public IoHandler,
                               public std::enable_shared_from_this<ClientConnection> {
 public:
  // `socket` has completed the hello; the target accepts ops up to `remote_max_op_bytes`.
  // `staging` moves ops on device memory (without a runtime, such ops are refused). The
  // connection runs on one loop of `pool`, which it keeps alive.
  ClientConnection(std::unique_ptr<Socket> socket, std::string endpoint, uint32_t lane,
                   uint64_t remote_max_op_bytes, GpuStaging staging, std::shared_ptr<IoPool> pool);
  ~ClientConnection() override;
  ClientConnection(const ClientConnection&) = delete;
  ClientConnection& operator=(const ClientConnection&) = delete;

  // Checks every host-memory op end to end (PeerLink::verify_checksums; the wire format is in
  // tcp_wire.h): a WRITE sends the CRC32C of its source, which the target checks where the
  // bytes landed; a READ's response brings the CRC32C of the target's source, checked here
  // where the bytes landed. A mismatch fails the request with DataLoss naming `peer_name`.
  // Call before Start.
  void SetVerifyChecksums(bool on, std::string peer_name) {
    verify_ = on;
    peer_name_ = std::move(peer_name);
  }

  // Makes the socket non-blocking and registers it with an I/O thread. Call once, on a
  // connection held by a shared_ptr, before Post.
  absl::Status Start();

  // Queues the ops of `request`; never blocks on the network. `done` runs exactly once: on
  // the connection's I/O thread when every op was answered (or the first failed), inline
  // when the connection is already closed or the request is invalid, or on the thread that
  // closes the connection for requests not yet on the wire.
  void Post(PostRequest request, DoneCallback done);

  // Fails every request with `reason` and shuts the socket down; idempotent (the first reason
  // wins). Requests not yet on the wire fail in this call; those on the wire fail on the
  // I/O thread as soon as it sees the shutdown.
  void Close(const absl::Status& reason);

  // Waits (bounded) until the I/O thread let go of the connection: no request's memory is
  // read or written any more and the socket is closed. Returns false (and waits for nothing)
  // on a thread of the I/O pool, where waiting could hold up the connection itself or its
  // neighbours. Call after Close.
  bool Join();
  // The I/O thread let go of the connection: Join() will not block.
  bool Exited() const { return exited_.load(std::memory_order_acquire); }

  const std::string& endpoint() const { return endpoint_; }

  void OnIo(uint32_t events) override;

 private:
  struct Pending {
    PostRequest request;
    DoneCallback done;
    uint64_t first_seq = 0;  // wire sequence of ops[0], assigned when it goes on the wire
  };
  // The ops of one gather send, their encoded headers, and the requests they belong to.
  struct WriterBatch {
    struct Slot {
      const Pending* pending;
      uint32_t op;
    };
    std::vector<Slot> slots;
    std::vector<std::array<std::byte, tcp_wire::kRequestBytes>> headers;
    GatherList gather;
    std::vector<std::shared_ptr<Pending>> holds;
    std::shared_ptr<Pending> current;  // a request whose ops did not all fit in one batch
    uint32_t next_op = 0;
    bool sending = false;  // `gather` is built and partly sent
  };
  // The receiving position: the request whose responses come next, and how far it got.
  struct ReaderState {
    enum class Phase { kHeader, kPayload, kMessage };
    Phase phase = Phase::kHeader;
    uint32_t op = 0;  // of in_flight_.front()
    bool head_cancelled = false;
    absl::Status head_error;  // the target's error for the head request, if it sent one
    // A checksum mismatch on one of the head's ops (verify_): the request fails with it; the
    // stream stays in sync.
    absl::Status head_corrupt;
    // kPayload / kMessage: the bytes expected and received so far.
    uint64_t length = 0;
    size_t done = 0;
    std::byte* dest = nullptr;  // nullptr: dropped
    tcp_wire::ResponseHeader header;
    std::string message;
  };

  // On the I/O thread: sends and receives what the socket allows, then returns to epoll.
  void Pump();
  // Sends batches until the socket is full or nothing is queued; sets *more when it stopped
  // for fairness.
  absl::Status SendSome(bool* more);
  // Takes the next batch off to_send_ (its requests go in flight); false when none.
  bool TakeBatch();
  void EncodeRequestHeaders();
  void GatherBatch();
  // Receives responses until the socket runs dry; sets *more when it stopped for fairness.
  absl::Status ReceiveSome(bool* more);
  // A response header is in: checks it and sets up its payload or message.
  absl::Status OnResponseHeader(const std::byte* raw);
  // The payload (or nothing) of the head's current op is in: on to the next op.
  absl::Status FinishOp();
  // The target's error message is in: the connection's error.
  absl::Status OnErrorMessage();
  // Every response of the head is in: waits for its staged copies and completes it.
  absl::Status CompleteHead();
  // Ends the connection on its I/O thread: fails what is in flight, unregisters and closes
  // the socket. Idempotent.
  void Teardown(const absl::Status& error);
  // Marks the connection failed with `status` (if it is the first), shuts the socket down,
  // fails the requests not yet on the wire, and has the I/O thread tear it down.
  void Fail(const absl::Status& status);
  // Asks the I/O thread to Pump (once, however many times it is asked before it runs).
  void Schedule();
  absl::Status ForRequest(const absl::Status& why, const Pending& pending) const;
  // Checks the READ payload of the head's current op against the target's CRC (verify_).
  void CheckReadPayload();
  // Records a checksum mismatch on the head's current op.
  void OnCorruptOp(const char* where, uint32_t expected, uint32_t actual);
  static void Complete(Pending& pending, const absl::Status& status);
  static bool Cancelled(const Pending& pending);

  const std::unique_ptr<Socket> socket_;
  const std::string endpoint_;
  const uint32_t lane_;
  const uint64_t remote_max_op_bytes_;
  const bool gpu_;  // a runtime is there for ops on device memory
  const std::shared_ptr<IoPool> pool_;
  IoLoop* loop_ = nullptr;  // set by Start
  bool verify_ = false;     // set before Start
  std::string peer_name_;

  // I/O thread only.
  StagedSender staged_out_;
  StagedReceiver staged_in_;
  HeaderReader reader_;
  WriterBatch batch_;
  ReaderState rx_;
  // On the wire (at least partly), in wire order.
  std::deque<std::shared_ptr<Pending>> in_flight_;
  uint64_t next_seq_ = 0;
  bool torn_down_ = false;

  Mutex mu_;
  CondVar exited_cv_;
  // OK while open; the first failure reason after.
  absl::Status closed_ ABSL_GUARDED_BY(mu_);
  // Posted, no byte sent yet. Failed by whoever closes the connection.
  std::deque<std::shared_ptr<Pending>> to_send_ ABSL_GUARDED_BY(mu_);
  bool scheduled_ ABSL_GUARDED_BY(mu_) = false;  // a Pump task is queued
  std::atomic<bool> exited_{false};
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_CLIENT_CONNECTION_H_
