// One data connection of a tcp channel, initiator side: a writer thread that sends op headers
// and WRITE payloads with gather I/O, many ops pipelined without waiting for responses, and a
// reader thread that receives the responses in order (READ data straight into local memory)
// and completes the requests. Device memory (WireOp::local_gpu_device >= 0) goes through
// pinned staging buffers instead (tcp_staging.h): one pair for the writer, one for the reader.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_CLIENT_CONNECTION_H_
#define KVWIRE_TRANSPORT_TCP_TCP_CLIENT_CONNECTION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"

#include "src/util/mutex.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_staging.h"
#include "transport/tcp/tcp_wire.h"
#include "transport/transport.h"

namespace kvwire::transport {

class ClientConnection {
 public:
  // `socket` has completed the hello; the target accepts ops up to `remote_max_op_bytes`.
  // `staging` moves ops on device memory (without a runtime, such ops are refused).
  ClientConnection(std::unique_ptr<Socket> socket, std::string endpoint, uint32_t lane,
                   uint64_t remote_max_op_bytes, GpuStaging staging);
  // Closes and joins. If that happens on one of the connection's own threads, the threads
  // are detached instead (the owner of the connection should have joined it elsewhere).
  ~ClientConnection();
  ClientConnection(const ClientConnection&) = delete;
  ClientConnection& operator=(const ClientConnection&) = delete;

  // Starts the writer and reader threads. Call once, before Post. ResourceExhausted when the
  // system has no thread to give (then Close and Join the connection).
  absl::Status Start();

  // Queues the ops of `request`; never blocks on the network. `done` runs exactly once: on
  // the reader thread when every op was answered (or the first failed), inline when the
  // connection is already closed or the request is invalid, or on the thread that closes the
  // connection for requests not yet on the wire.
  void Post(PostRequest request, DoneCallback done);

  // Fails every request with `reason` and shuts the socket down; idempotent (the first reason
  // wins). Requests not yet on the wire fail in this call; those on the wire fail on the
  // reader thread as soon as it sees the shutdown (within milliseconds).
  void Close(const absl::Status& reason);

  // Waits for both threads to return, then closes the socket. Returns false (and waits for
  // nothing) when called on one of the connection's own threads. Call after Close.
  bool Join();
  // Both threads have returned: Join() will not block.
  bool Exited() const { return exited_.load(std::memory_order_acquire) == 2; }

  const std::string& endpoint() const { return endpoint_; }

 private:
  struct Pending {
    PostRequest request;
    DoneCallback done;
    uint64_t first_seq = 0;  // wire sequence of ops[0], assigned when it goes on the wire
    // Both guarded by mu_. A WRITE request completes only when the reader has every response
    // (`acked`) AND the writer's last sendmsg that read its memory has returned (`released`):
    // a response can overtake the return of that sendmsg. Whichever of the two threads sets
    // the second flag completes the request, with `result`.
    bool acked = false;
    bool released = false;
    absl::Status result;
  };
  struct WriterBatch;
  struct ReaderState;

  // Writer thread: takes a batch of ops, encodes their headers, gathers headers and WRITE
  // payloads, sends them (device payloads through the staging buffers), releases the batch.
  void WriterLoop();
  // Waits for requests and takes the next batch off to_send_ (its requests go in flight);
  // false once the connection is closed.
  bool TakeBatch(WriterBatch& batch) ABSL_LOCKS_EXCLUDED(mu_);
  static void EncodeRequestHeaders(WriterBatch& batch);
  static void GatherBatch(WriterBatch& batch);
  // The writer returns: what it may still hold cannot be sent any more.
  void WriterExited(WriterBatch& batch) ABSL_LOCKS_EXCLUDED(mu_);

  // Reader thread: reads the responses of the requests in flight, in order, READ payloads
  // into local memory, and completes each request after its last response.
  void ReaderLoop();
  // Makes state.head the request whose responses come next, waiting for one; false once the
  // connection is closed.
  bool NextInFlight(ReaderState& state) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads and checks the response to state.head's next op (and its payload). An error is the
  // connection's: it ends the reader.
  absl::Status ReadResponse(HeaderReader& reader, ReaderState& state);
  // The target refused an op or the stream: reads its message, records the op's error in
  // state.head_error when the refusal is for that op, and returns the connection's error.
  absl::Status ReadErrorResponse(HeaderReader& reader, const tcp_wire::ResponseHeader& h,
                                 ReaderState& state);
  // Receives a READ's payload into the op's local memory (host, or device through the
  // staging buffers), or drops it when the transfer was cancelled.
  absl::Status ReceiveReadPayload(HeaderReader& reader, const WireOp& wop, uint64_t payload,
                                  ReaderState& state);
  // Every response of state.head is in: waits for its staged copies and completes it (or
  // leaves that to the writer when its send has not returned yet).
  absl::Status CompleteHead(ReaderState& state) ABSL_LOCKS_EXCLUDED(mu_);
  // The reader returns: fails the connection with `error` (if any) and every request left.
  void ReaderExited(const ReaderState& state, const absl::Status& error) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks `batch` released after the writer's send returned; returns the requests that were
  // already acked, for the caller to complete.
  std::vector<std::shared_ptr<Pending>> Release(const std::vector<std::shared_ptr<Pending>>& batch,
                                                const Pending* still_sending);
  // Marks the connection failed with `status` (if it is the first), wakes both threads, and
  // fails the requests not yet on the wire.
  void Fail(const absl::Status& status);
  // The status `why` as seen by one request: names its transfer and this connection.
  absl::Status ForRequest(const absl::Status& why, const Pending& pending) const;
  static void Complete(Pending& pending, const absl::Status& status);
  static bool Cancelled(const Pending& pending);

  const std::unique_ptr<Socket> socket_;
  const std::string endpoint_;
  const uint32_t lane_;
  const uint64_t remote_max_op_bytes_;
  const bool gpu_;  // a runtime is there for ops on device memory
  // WRITE payloads on device memory; used by the writer thread only.
  StagedSender staged_out_;
  // READ payloads into device memory; used by the reader thread only.
  StagedReceiver staged_in_;

  Mutex mu_;
  CondVar writer_cv_;  // to_send_ grew, or closed
  CondVar reader_cv_;  // in_flight_ grew, or closed
  // OK while open; the first failure reason after.
  absl::Status closed_ ABSL_GUARDED_BY(mu_);
  // Posted, no byte sent yet. Failed by whoever closes the connection.
  std::deque<std::shared_ptr<Pending>> to_send_ ABSL_GUARDED_BY(mu_);
  // On the wire (at least partly), in wire order. Only the reader completes these.
  std::deque<std::shared_ptr<Pending>> in_flight_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // The writer returned: it reads no request's memory any more.
  bool writer_exited_ ABSL_GUARDED_BY(mu_) = false;

  Mutex join_mu_;  // std::thread::join must not run concurrently on one thread object
  std::thread writer_ ABSL_GUARDED_BY(join_mu_);
  std::thread reader_ ABSL_GUARDED_BY(join_mu_);
  // Set by Start before any other thread can see the connection; read-only after.
  std::thread::id writer_id_;
  std::thread::id reader_id_;
  std::atomic<int> exited_{0};
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_CLIENT_CONNECTION_H_
