#include "transport/tcp/tcp_client_connection.h"

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

#include "src/util/crc32c.h"
#include "src/util/fault_injection.h"
#include "src/util/log.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

// One sendmsg carries at most this many ops (two iovecs each) or about this many payload
// bytes: enough to amortise the system call, small enough to keep responses flowing.
constexpr size_t kMaxBatchOps = 256;
constexpr uint64_t kMaxBatchBytes = 4 << 20;
// One turn of a connection on its I/O thread moves at most about this much in each direction
// before the thread serves the other connections (and comes back to this one).
constexpr uint64_t kTurnBytes = 16 << 20;
// How long Join waits for the I/O thread to let go of the connection (it only has to fail
// the requests in flight and close the socket; staged copies may take longer).
constexpr absl::Duration kJoinWait = absl::Seconds(60);

}  // namespace

ClientConnection::ClientConnection(std::unique_ptr<Socket> socket, std::string endpoint,
                                   uint32_t lane, uint64_t remote_max_op_bytes, GpuStaging staging,
                                   std::shared_ptr<IoPool> pool)
    : socket_(std::move(socket)),
      endpoint_(std::move(endpoint)),
      lane_(lane),
      remote_max_op_bytes_(remote_max_op_bytes),
      gpu_(staging.runtime != nullptr),
      pool_(std::move(pool)),
      staged_out_(staging),
      staged_in_(staging),
      reader_(socket_->fd(), wire::kResponseBytes, /*output=*/nullptr) {}

ClientConnection::~ClientConnection() {
  // Only reached once no loop holds the connection: torn down there, never registered, or
  // its loop stopped. In the last two cases nothing else can run its I/O-thread state now.
  Close(absl::CancelledError(absl::StrCat("tcp connection to ", endpoint_, " destroyed")));
  Teardown(absl::CancelledError(absl::StrCat("tcp connection to ", endpoint_, " destroyed")));
}

absl::Status ClientConnection::Start() {
  if (absl::Status s = SetNonBlocking(socket_->fd(), true); !s.ok()) return s;
  loop_ = pool_->Pick();
  std::shared_ptr<ClientConnection> self = shared_from_this();
  const bool queued = loop_->Run([self] {
    if (absl::Status s = self->loop_->Add(self->socket_->fd(), self); !s.ok()) {
      self->Fail(absl::InternalError(
          absl::StrCat("tcp connection to ", self->endpoint_, ": ", s.message())));
    }
    self->Pump();
  });
  if (!queued) {
    loop_ = nullptr;
    return absl::UnavailableError("the tcp transport's I/O threads stopped");
  }
  return absl::OkStatus();
}

bool ClientConnection::Join() {
  if (loop_ == nullptr) {
    // Never started: no thread ever saw it.
    torn_down_ = true;
    socket_->Close();
    exited_.store(true, std::memory_order_release);
    return true;
  }
  if (pool_->OnPoolThread()) return false;
  MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + kJoinWait;
  while (!exited_.load(std::memory_order_acquire)) {
    if (!exited_cv_.WaitUntil(&mu_, deadline) && absl::Now() >= deadline) {
      KVW_LOG(kError, "tcp") << "data connection not released by its I/O thread in time"
                             << Kv("endpoint", endpoint_) << Kv("lane", lane_);
      return false;
    }
  }
  return true;
}

bool ClientConnection::Cancelled(const Pending& pending) {
  return pending.request.cancelled != nullptr &&
         pending.request.cancelled->load(std::memory_order_acquire);
}

void ClientConnection::Complete(Pending& pending, const absl::Status& status) {
  // Moved out so that the callback (and what it captured) is released right after it ran.
  DoneCallback done = std::move(pending.done);
  if (done) done(status);
}

absl::Status ClientConnection::ForRequest(const absl::Status& why, const Pending& pending) const {
  return absl::Status(why.code(),
                      absl::StrCat("transfer ", pending.request.transfer_id, ": ", why.message()));
}

void ClientConnection::Post(PostRequest request, DoneCallback done) {
  for (size_t i = 0; i < request.ops.size(); ++i) {
    const WireOp& op = request.ops[i];
    if (op.length > remote_max_op_bytes_) {
      done(absl::InvalidArgumentError(absl::StrCat(
          "transfer ", request.transfer_id, " op ", i, ": length ", op.length,
          " exceeds the max_op_bytes ", remote_max_op_bytes_, " of tcp target ", endpoint_)));
      return;
    }
    if (op.local == nullptr && op.length > 0) {
      done(absl::InvalidArgumentError(
          absl::StrCat("transfer ", request.transfer_id, " op ", i, ": no local address")));
      return;
    }
    if (op.local_gpu_device >= 0 && !gpu_) {
      done(absl::FailedPreconditionError(
          absl::StrCat("transfer ", request.transfer_id, " op ", i, ": local memory is on GPU ",
                       op.local_gpu_device, " and this tcp transport has no GPU runtime")));
      return;
    }
  }
  if (request.ops.empty()) {
    done(absl::OkStatus());
    return;
  }
  auto pending = std::make_shared<Pending>();
  pending->request = std::move(request);
  pending->done = std::move(done);
  absl::Status closed;
  {
    MutexLock lock(&mu_);
    if (closed_.ok()) {
      to_send_.push_back(std::move(pending));
      if (scheduled_) return;
      scheduled_ = true;
    } else {
      closed = closed_;
    }
  }
  if (closed.ok()) {
    std::shared_ptr<ClientConnection> self = shared_from_this();
    if (loop_ == nullptr || !loop_->Run([self] { self->Pump(); })) {
      Fail(absl::UnavailableError(
          absl::StrCat("tcp connection to ", endpoint_, ": the transport's I/O threads stopped")));
    }
    return;
  }
  Complete(*pending, ForRequest(closed, *pending));
}

void ClientConnection::Schedule() {
  {
    MutexLock lock(&mu_);
    if (scheduled_) return;
    scheduled_ = true;
  }
  // Not from the destructor (no owner left to hand to the loop).
  std::shared_ptr<ClientConnection> self = weak_from_this().lock();
  if (self != nullptr && loop_ != nullptr) (void)loop_->Run([self] { self->Pump(); });
}

void ClientConnection::Close(const absl::Status& reason) {
  Fail(reason.ok() ? absl::CancelledError(absl::StrCat("tcp connection to ", endpoint_, " closed"))
                   : reason);
}

void ClientConnection::Fail(const absl::Status& status) {
  std::deque<std::shared_ptr<Pending>> unsent;
  {
    MutexLock lock(&mu_);
    if (!closed_.ok()) return;
    closed_ = status;
    unsent.swap(to_send_);
  }
  KVW_LOG(kInfo, "tcp") << "data connection closed" << Kv("endpoint", endpoint_)
                        << Kv("lane", lane_) << Kv("reason", status.message());
  socket_->Shutdown();
  for (const std::shared_ptr<Pending>& pending : unsent) {
    Complete(*pending, ForRequest(status, *pending));
  }
  // The I/O thread fails what is in flight (it alone touches that); not from a destructor.
  Schedule();
}

void ClientConnection::OnIo(uint32_t /*events*/) { Pump(); }

void ClientConnection::Pump() {
  // Teardown lets go of the loop's reference; this one keeps the connection until the end.
  const std::shared_ptr<ClientConnection> self = shared_from_this();
  {
    MutexLock lock(&mu_);
    scheduled_ = false;
  }
  if (torn_down_) return;
  absl::Status closed;
  {
    MutexLock lock(&mu_);
    closed = closed_;
  }
  if (!closed.ok()) {
    Teardown(closed);
    return;
  }
  // Set when a direction stopped for fairness with bytes still waiting: edge-triggered epoll
  // will not report them again, so the connection queues itself for another turn.
  bool more = false;
  absl::Status s = SendSome(&more);
  if (s.ok()) s = ReceiveSome(&more);
  if (!s.ok()) {
    Fail(s);
    Teardown(s);
    return;
  }
  if (more) Schedule();
}

absl::Status ClientConnection::SendSome(bool* more) {
  uint64_t sent = 0;
  while (true) {
    if (sent >= kTurnBytes) {
      *more = true;
      return absl::OkStatus();
    }
    if (!batch_.sending) {
      if (!TakeBatch()) return absl::OkStatus();
      EncodeRequestHeaders();
      GatherBatch();
      batch_.sending = true;
      if (batch_.gather.staged()) {
        // Device payloads go through the staging buffers, blocking this thread meanwhile;
        // when this returns, no copy reads the batch's memory any more.
        const absl::Status s = batch_.gather.Send(socket_->fd(), staged_out_);
        batch_.sending = false;
        batch_.holds.clear();
        if (!s.ok()) {
          return absl::UnavailableError(
              absl::StrCat("tcp connection to ", endpoint_, " lost: ", s.message()));
        }
        sent += kMaxBatchBytes;
        continue;
      }
    }
    absl::StatusOr<bool> done = batch_.gather.SendSome(socket_->fd());
    if (!done.ok()) {
      return absl::UnavailableError(
          absl::StrCat("tcp connection to ", endpoint_, " lost: ", done.status().message()));
    }
    if (!*done) return absl::OkStatus();  // the socket is full: EPOLLOUT brings us back
    batch_.sending = false;
    batch_.holds.clear();
    sent += kMaxBatchBytes;
  }
}

bool ClientConnection::TakeBatch() {
  WriterBatch& batch = batch_;
  batch.slots.clear();
  batch.holds.clear();
  uint64_t batch_bytes = 0;
  MutexLock lock(&mu_);
  if (!closed_.ok()) return false;
  while (batch.slots.size() < kMaxBatchOps && batch_bytes < kMaxBatchBytes) {
    if (batch.current == nullptr) {
      if (to_send_.empty()) break;
      batch.current = std::move(to_send_.front());
      to_send_.pop_front();
      // In flight before its first byte is sent, so that its responses are expected.
      batch.current->first_seq = next_seq_;
      next_seq_ += batch.current->request.ops.size();
      in_flight_.push_back(batch.current);
      batch.next_op = 0;
    }
    batch.holds.push_back(batch.current);
    const WireOps& ops = batch.current->request.ops;
    const bool write = batch.current->request.kind == OpKind::kWrite;
    while (batch.next_op < ops.size() && batch.slots.size() < kMaxBatchOps &&
           batch_bytes < kMaxBatchBytes) {
      batch.slots.push_back({batch.current.get(), batch.next_op});
      batch_bytes += write ? ops[batch.next_op].length : 0;
      ++batch.next_op;
    }
    if (batch.next_op == ops.size()) batch.current.reset();
  }
  return !batch.slots.empty();
}

void ClientConnection::EncodeRequestHeaders() {
  WriterBatch& batch = batch_;
  // Grown to the largest batch seen, not to kMaxBatchOps: idle connections stay small.
  if (batch.headers.size() < batch.slots.size()) batch.headers.resize(batch.slots.size());
  // Back to front: `follow` counts the headers after an op's payload up to and including the
  // next one that carries a payload.
  uint16_t follow = 0;
  for (size_t i = batch.slots.size(); i-- > 0;) {
    const Pending& p = *batch.slots[i].pending;
    const WireOp& op = p.request.ops[batch.slots[i].op];
    const bool write = p.request.kind == OpKind::kWrite;
    wire::RequestHeader h;
    h.kind = wire::WireKind(p.request.kind);
    h.flags = write && p.request.count_arrivals ? wire::kFlagCountArrivals : 0;
    h.follow = follow;
    h.op_index = batch.slots[i].op;
    h.sequence = p.first_seq + batch.slots[i].op;
    h.transfer_id = p.request.transfer_id;
    h.region = op.remote_region;
    h.offset = op.remote_offset;
    h.length = op.length;
    h.grant = p.request.grant;
    if (verify_ && op.local_gpu_device < 0) {
      // The initiator has the bytes of a WRITE: their CRC goes with the header (one pass over
      // the source, on this thread, before the payload is sent).
      h.flags |= wire::kFlagChecksum;
      if (write) h.crc = Crc32c(op.local, op.length);
    }
    wire::EncodeRequest(h, batch.headers[i].data());
    const bool has_payload = write && op.length > 0;
    follow = has_payload ? 1 : static_cast<uint16_t>(std::min<int>(follow + 1, wire::kMaxFollow));
  }
}

void ClientConnection::GatherBatch() {
  WriterBatch& batch = batch_;
  batch.gather.Clear();
  for (size_t i = 0; i < batch.slots.size(); ++i) {
    // Adjacent headers (READs) share one iovec: the header array is contiguous.
    batch.gather.AddHeader(batch.headers[i].data(), wire::kRequestBytes);
    const Pending& p = *batch.slots[i].pending;
    const WireOp& op = p.request.ops[batch.slots[i].op];
    if (p.request.kind == OpKind::kWrite && op.length > 0) {
      batch.gather.AddPayload(op.local, op.length, op.local_gpu_device);
    }
  }
}

absl::Status ClientConnection::ReceiveSome(bool* more) {
  uint64_t received = 0;
  while (true) {
    if (received >= kTurnBytes) {
      *more = true;
      return absl::OkStatus();
    }
    switch (rx_.phase) {
      case ReaderState::Phase::kHeader: {
        absl::StatusOr<const std::byte*> raw = reader_.TryNext();
        if (!raw.ok()) {
          return absl::UnavailableError(
              absl::StrCat("tcp connection to ", endpoint_, " lost: ", raw.status().message()));
        }
        if (*raw == nullptr) return absl::OkStatus();
        received += wire::kResponseBytes;
        if (absl::Status s = OnResponseHeader(*raw); !s.ok()) return s;
        break;
      }
      case ReaderState::Phase::kPayload: {
        // Once the engine ended the transfer, its local memory is no longer ours to write:
        // the rest of the payload is dropped (the stream stays in sync).
        if (rx_.dest != nullptr && Cancelled(*in_flight_.front())) {
          rx_.head_cancelled = true;
          rx_.dest = nullptr;
        }
        const size_t before = rx_.done;
        absl::StatusOr<bool> done = reader_.TryReadTrailing(rx_.dest, rx_.length, &rx_.done);
        if (!done.ok()) {
          return absl::UnavailableError(
              absl::StrCat("tcp connection to ", endpoint_, " lost: ", done.status().message()));
        }
        received += rx_.done - before;
        if (!*done) return absl::OkStatus();
        if (absl::Status s = FinishOp(); !s.ok()) return s;
        break;
      }
      case ReaderState::Phase::kMessage: {
        absl::StatusOr<bool> done = reader_.TryReadTrailing(
            reinterpret_cast<std::byte*>(rx_.message.data()), rx_.length, &rx_.done);
        if (!done.ok()) {
          rx_.message = absl::StrCat("(message lost: ", done.status().message(), ")");
          return OnErrorMessage();
        }
        if (!*done) return absl::OkStatus();
        return OnErrorMessage();
      }
    }
  }
}

absl::Status ClientConnection::OnResponseHeader(const std::byte* raw) {
  wire::ResponseHeader& h = rx_.header;
  if (absl::Status s = wire::DecodeResponse(raw, &h); !s.ok()) {
    return absl::DataLossError(
        absl::StrCat("tcp protocol error from ", endpoint_, ": ", s.message()));
  }
  if (h.code != 0) {
    // The target refused an op (or our stream); it closes the connection after the message.
    rx_.message.assign(h.message_len, '\0');
    if (absl::Status s = reader_.Expect(h.message_len, 0); !s.ok()) {
      rx_.message = absl::StrCat("(message lost: ", s.message(), ")");
      return OnErrorMessage();
    }
    if (h.message_len == 0) return OnErrorMessage();
    rx_.phase = ReaderState::Phase::kMessage;
    rx_.length = h.message_len;
    rx_.done = 0;
    return absl::OkStatus();
  }
  if (in_flight_.empty()) {
    return absl::DataLossError(absl::StrCat("tcp protocol error from ", endpoint_,
                                            ": response seq ", h.sequence,
                                            " with no request in flight"));
  }
  const Pending& head = *in_flight_.front();
  const uint64_t expected_seq = head.first_seq + rx_.op;
  const WireOp& wop = head.request.ops[rx_.op];
  const bool read = head.request.kind == OpKind::kRead;
  const uint64_t payload = read ? wop.length : 0;
  if (h.sequence != expected_seq || h.kind != wire::WireKind(head.request.kind) ||
      h.payload_len != payload) {
    return absl::DataLossError(absl::StrCat(
        "tcp protocol error from ", endpoint_, ": response seq ", h.sequence, " kind ",
        wire::WireKindName(h.kind), " payload ", h.payload_len, ", expected seq ", expected_seq,
        " kind ", wire::WireKindName(wire::WireKind(head.request.kind)), " payload ", payload,
        " (transfer ", head.request.transfer_id, " op ", rx_.op, ")"));
  }
  if (absl::Status s = reader_.Expect(payload, h.follow); !s.ok()) {
    return absl::DataLossError(
        absl::StrCat("tcp protocol error from ", endpoint_, ": ", s.message()));
  }
  if (verify_ && wop.local_gpu_device < 0 && !read &&
      (h.flags & wire::kResponseFlagChecksumMismatch) != 0) {
    // The target computed h.crc where our WRITE landed; we sent the CRC of our source.
    OnCorruptOp("at the target after the WRITE", Crc32c(wop.local, wop.length), h.crc);
  }
  if (payload == 0) return FinishOp();
  rx_.head_cancelled = rx_.head_cancelled || Cancelled(head);
  if (!rx_.head_cancelled && wop.local_gpu_device >= 0) {
    // Device memory: through the staging buffers, blocking this thread while the payload
    // arrives (CompleteHead waits for the last copies).
    absl::Status s = staged_in_.Receive(reader_, wop.local_gpu_device, wop.local, payload,
                                        head.request.cancelled.get());
    if (absl::IsCancelled(s)) {
      rx_.head_cancelled = true;  // ended mid-payload; the stream is still in sync
      s = absl::OkStatus();
    }
    if (!s.ok()) {
      return absl::UnavailableError(
          absl::StrCat("tcp connection to ", endpoint_, " lost: ", s.message()));
    }
    return FinishOp();
  }
  rx_.phase = ReaderState::Phase::kPayload;
  rx_.length = payload;
  rx_.done = 0;
  rx_.dest = rx_.head_cancelled ? nullptr : wop.local;
  return absl::OkStatus();
}

void ClientConnection::OnCorruptOp(const char* where, uint32_t expected, uint32_t actual) {
  const Pending& head = *in_flight_.front();
  const WireOp& wop = head.request.ops[rx_.op];
  KVW_LOG(kWarning, "tcp") << "checksum mismatch" << Kv("transfer", head.request.transfer_id)
                           << Kv("op", rx_.op) << Kv("peer", peer_name_)
                           << Kv("endpoint", endpoint_);
  if (!rx_.head_corrupt.ok()) return;  // the first op that failed names the request's error
  rx_.head_corrupt = absl::DataLossError(absl::StrFormat(
      "transfer %u op %u (%s remote region %u offset %u length %u) with peer %s over tcp %s: "
      "end-to-end checksum mismatch %s (CRC32C of the source 0x%08x, of the bytes that "
      "landed 0x%08x): the op's bytes were corrupted on the way",
      head.request.transfer_id, rx_.op, wire::WireKindName(wire::WireKind(head.request.kind)),
      wop.remote_region, wop.remote_offset, wop.length, peer_name_, endpoint_, where, expected,
      actual));
}

void ClientConnection::CheckReadPayload() {
  const wire::ResponseHeader& h = rx_.header;
  const Pending& head = *in_flight_.front();
  const WireOp& wop = head.request.ops[rx_.op];
  if (rx_.dest == nullptr || wop.local_gpu_device >= 0) return;  // dropped, or on a device
  fault_injection::MaybeFlipPayloadByte(fault_injection::Site::kTcp, wop.local, wop.length);
  if (!verify_) return;
  // A target leaves the checksum out only where it cannot compute one: its region is device
  // memory, sent through staging buffers (docs/CHECKSUMS.md: not covered).
  if ((h.flags & wire::kResponseFlagChecksum) == 0) return;
  const uint32_t landed = Crc32c(wop.local, wop.length);
  if (landed != h.crc) OnCorruptOp("after the READ", h.crc, landed);
}

absl::Status ClientConnection::FinishOp() {
  if (rx_.phase == ReaderState::Phase::kPayload) CheckReadPayload();
  rx_.phase = ReaderState::Phase::kHeader;
  if (++rx_.op == in_flight_.front()->request.ops.size()) return CompleteHead();
  return absl::OkStatus();
}

absl::Status ClientConnection::OnErrorMessage() {
  const wire::ResponseHeader& h = rx_.header;
  const absl::StatusCode code = wire::CodeFromWire(h.code);
  const std::string& message = rx_.message;
  if (in_flight_.empty() || h.sequence != in_flight_.front()->first_seq + rx_.op) {
    return absl::Status(
        code, absl::StrCat("tcp target ", endpoint_, " reported a protocol error: ", message));
  }
  const Pending& head = *in_flight_.front();
  const WireOp& wop = head.request.ops[rx_.op];
  rx_.head_error = absl::Status(
      code, absl::StrCat("transfer ", head.request.transfer_id, " op ", rx_.op, " (",
                         wire::WireKindName(wire::WireKind(head.request.kind)), " remote region ",
                         wop.remote_region, " offset ", wop.remote_offset, " length ", wop.length,
                         ") failed at tcp target ", endpoint_, ": ", message));
  return absl::Status(code, absl::StrCat("tcp connection to ", endpoint_,
                                         " closed by the target after an error: ", message));
}

absl::Status ClientConnection::CompleteHead() {
  if (staged_in_.has_work()) {
    // The READ completes only once its last bytes reached the device.
    absl::Status s = staged_in_.Drain();
    if (absl::IsCancelled(s)) {
      rx_.head_cancelled = true;
    } else if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("tcp connection to ", endpoint_, ": ", s.message()));
    }
  }
  const std::shared_ptr<Pending> head = std::move(in_flight_.front());
  in_flight_.pop_front();
  absl::Status result =
      rx_.head_cancelled || Cancelled(*head)
          ? absl::CancelledError(absl::StrCat("transfer ", head->request.transfer_id,
                                              " was cancelled; its tcp responses were "
                                              "discarded"))
          : absl::OkStatus();
  if (result.ok() && !rx_.head_corrupt.ok()) result = rx_.head_corrupt;
  rx_.op = 0;
  rx_.head_cancelled = false;
  rx_.head_corrupt = absl::OkStatus();
  // Every payload byte of the request was sent (the target acked it) and received: nothing
  // reads or writes its memory any more.
  Complete(*head, result);
  return absl::OkStatus();
}

void ClientConnection::Teardown(const absl::Status& error) {
  if (torn_down_) return;
  torn_down_ = true;
  absl::Status why;
  std::deque<std::shared_ptr<Pending>> unsent;
  {
    MutexLock lock(&mu_);
    if (closed_.ok()) closed_ = error;
    why = closed_;
    unsent.swap(to_send_);
  }
  socket_->Shutdown();
  // Copies into the device memory of requests about to fail must end before they do.
  if (absl::Status s = staged_in_.Abandon(); !s.ok()) {
    KVW_LOG(kError, "tcp") << "staging copies failed" << Kv("endpoint", endpoint_)
                           << Kv("error", s.message());
  }
  batch_.sending = false;
  batch_.holds.clear();
  batch_.current.reset();
  batch_.gather.Clear();
  std::deque<std::shared_ptr<Pending>> failed;
  failed.swap(in_flight_);
  const absl::Status head_error = rx_.head_error;
  for (size_t i = 0; i < failed.size(); ++i) {
    Complete(*failed[i], i == 0 && !head_error.ok() ? head_error : ForRequest(why, *failed[i]));
  }
  for (const std::shared_ptr<Pending>& pending : unsent) {
    Complete(*pending, ForRequest(why, *pending));
  }
  if (loop_ != nullptr && loop_->OnLoopThread()) loop_->Remove(socket_->fd());
  socket_->Close();
  MutexLock lock(&mu_);
  exited_.store(true, std::memory_order_release);
  exited_cv_.SignalAll();
}

}  // namespace kvwire::transport
