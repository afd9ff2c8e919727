#include "transport/tcp/tcp_client_connection.h"

#include <algorithm>
#include <array>
#include <pthread.h>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "transport/tcp/tcp_gather.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

// One sendmsg carries at most this many ops (two iovecs each) or about this many payload
// bytes: enough to amortise the system call, small enough to keep responses flowing.
constexpr size_t kMaxBatchOps = 256;
constexpr uint64_t kMaxBatchBytes = 4 << 20;

}  // namespace

ClientConnection::ClientConnection(std::unique_ptr<Socket> socket, std::string endpoint,
                                   uint32_t lane, uint64_t remote_max_op_bytes, GpuStaging staging)
    : socket_(std::move(socket)),
      endpoint_(std::move(endpoint)),
      lane_(lane),
      remote_max_op_bytes_(remote_max_op_bytes),
      gpu_(staging.runtime != nullptr),
      staged_out_(staging),
      staged_in_(staging) {}

ClientConnection::~ClientConnection() {
  Close(absl::CancelledError(absl::StrCat("tcp connection to ", endpoint_, " destroyed")));
  if (!Join()) {
    KVW_LOG(kError, "tcp") << "connection destroyed on its own thread; detaching its threads"
                           << Kv("endpoint", endpoint_) << Kv("lane", lane_);
    MutexLock lock(&join_mu_);
    if (writer_.joinable()) writer_.detach();
    if (reader_.joinable()) reader_.detach();
  }
}

absl::Status ClientConnection::Start() {
  MutexLock lock(&join_mu_);
  try {
    writer_ = std::thread([this] { WriterLoop(); });
    writer_id_ = writer_.get_id();
    reader_ = std::thread([this] { ReaderLoop(); });
    reader_id_ = reader_.get_id();
  } catch (const std::system_error& e) {
    // The owner's Close and Join end a writer that did start.
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start the connection's threads: ", e.what()));
  }
  return absl::OkStatus();
}

bool ClientConnection::Join() {
  const std::thread::id self = std::this_thread::get_id();
  if (self == writer_id_ || self == reader_id_) return false;
  MutexLock lock(&join_mu_);
  if (writer_.joinable()) writer_.join();
  if (reader_.joinable()) reader_.join();
  socket_->Close();
  return true;
}

bool ClientConnection::Cancelled(const Pending& pending) {
  return pending.request.cancelled != nullptr &&
         pending.request.cancelled->load(std::memory_order_acquire);
}

void ClientConnection::Complete(Pending& pending, const absl::Status& status) {
  // Moved out so that the callback (and what it captured) is released right after it ran,
  // while the ops and pins stay valid for a writer that may still be sending them.
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
      writer_cv_.Signal();
      return;
    }
    closed = closed_;
  }
  Complete(*pending, ForRequest(closed, *pending));
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
    writer_cv_.SignalAll();
    reader_cv_.SignalAll();
  }
  KVW_LOG(kInfo, "tcp") << "data connection closed" << Kv("endpoint", endpoint_)
                        << Kv("lane", lane_) << Kv("reason", status.message());
  socket_->Shutdown();
  for (const std::shared_ptr<Pending>& pending : unsent) {
    Complete(*pending, ForRequest(status, *pending));
  }
}

std::vector<std::shared_ptr<ClientConnection::Pending>> ClientConnection::Release(
    const std::vector<std::shared_ptr<Pending>>& batch, const Pending* still_sending) {
  std::vector<std::shared_ptr<Pending>> ready;
  MutexLock lock(&mu_);
  for (const std::shared_ptr<Pending>& pending : batch) {
    if (pending.get() == still_sending || pending->released) continue;
    pending->released = true;
    if (pending->acked) ready.push_back(pending);
  }
  return ready;
}

// The writer's batch: the ops of one gather send, their encoded headers, and the requests
// they belong to (kept alive, ops and pins, while their bytes are sent).
struct ClientConnection::WriterBatch {
  struct Slot {
    const Pending* pending;
    uint32_t op;
  };
  WriterBatch() : headers(kMaxBatchOps) {
    slots.reserve(kMaxBatchOps);
    gather.Reserve(2 * kMaxBatchOps);
    holds.reserve(kMaxBatchOps);
  }
  std::vector<Slot> slots;
  std::vector<std::array<std::byte, wire::kRequestBytes>> headers;
  GatherList gather;
  std::vector<std::shared_ptr<Pending>> holds;
  std::shared_ptr<Pending> current;  // a request whose ops did not all fit in one batch
  uint32_t next_op = 0;
};

void ClientConnection::WriterLoop() {
  pthread_setname_np(pthread_self(), "kvw-tcp-send");
  WriterBatch batch;
  while (TakeBatch(batch)) {
    EncodeRequestHeaders(batch);
    GatherBatch(batch);
    // Device payloads go through the staging buffers; when this returns, no copy reads the
    // batch's memory any more.
    const absl::Status sent = batch.gather.Send(socket_->fd(), staged_out_);
    for (const std::shared_ptr<Pending>& pending : Release(batch.holds, batch.current.get())) {
      Complete(*pending, pending->result);
    }
    if (!sent.ok()) {
      Fail(absl::UnavailableError(
          absl::StrCat("tcp connection to ", endpoint_, " lost: ", sent.message())));
      break;
    }
  }
  WriterExited(batch);
}

bool ClientConnection::TakeBatch(WriterBatch& batch) {
  batch.slots.clear();
  batch.holds.clear();
  uint64_t batch_bytes = 0;
  MutexLock lock(&mu_);
  while (closed_.ok() && batch.current == nullptr && to_send_.empty()) writer_cv_.Wait(&mu_);
  if (!closed_.ok()) return false;
  while (batch.slots.size() < kMaxBatchOps && batch_bytes < kMaxBatchBytes) {
    if (batch.current == nullptr) {
      if (to_send_.empty()) break;
      batch.current = std::move(to_send_.front());
      to_send_.pop_front();
      // In flight before its first byte is sent, so the reader expects its responses.
      batch.current->first_seq = next_seq_;
      next_seq_ += batch.current->request.ops.size();
      // The writer never touches a READ's local memory: nothing to wait for.
      batch.current->released = batch.current->request.kind == OpKind::kRead;
      in_flight_.push_back(batch.current);
      reader_cv_.Signal();
      batch.next_op = 0;
    }
    batch.holds.push_back(batch.current);
    const std::vector<WireOp>& ops = batch.current->request.ops;
    const bool write = batch.current->request.kind == OpKind::kWrite;
    while (batch.next_op < ops.size() && batch.slots.size() < kMaxBatchOps &&
           batch_bytes < kMaxBatchBytes) {
      batch.slots.push_back({batch.current.get(), batch.next_op});
      batch_bytes += write ? ops[batch.next_op].length : 0;
      ++batch.next_op;
    }
    if (batch.next_op == ops.size()) batch.current.reset();
  }
  return true;
}

void ClientConnection::EncodeRequestHeaders(WriterBatch& batch) {
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
    wire::EncodeRequest(h, batch.headers[i].data());
    const bool has_payload = write && op.length > 0;
    follow = has_payload ? 1 : static_cast<uint16_t>(std::min<int>(follow + 1, wire::kMaxFollow));
  }
}

void ClientConnection::GatherBatch(WriterBatch& batch) {
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

void ClientConnection::WriterExited(WriterBatch& batch) {
  {
    // Every batch was released after its send; only a partly sent request may remain, and it
    // cannot be acked. The reader fails what is left once it sees writer_exited_.
    MutexLock lock(&mu_);
    for (const std::shared_ptr<Pending>& pending : in_flight_) pending->released = true;
    if (batch.current != nullptr) batch.current->released = true;
    writer_exited_ = true;
    reader_cv_.SignalAll();
  }
  exited_.fetch_add(1, std::memory_order_acq_rel);
}

// The reader's position: the request whose responses come next, and how far it got.
struct ClientConnection::ReaderState {
  std::shared_ptr<Pending> head;
  uint32_t op = 0;
  bool head_cancelled = false;
  absl::Status head_error;  // the target's error for `head`, if it sent one
};

void ClientConnection::ReaderLoop() {
  pthread_setname_np(pthread_self(), "kvw-tcp-recv");
  HeaderReader reader(socket_->fd(), wire::kResponseBytes, /*output=*/nullptr);
  ReaderState state;
  absl::Status error;  // why this loop failed the connection, if it did
  while (NextInFlight(state)) {
    error = ReadResponse(reader, state);
    if (!error.ok()) break;
    if (++state.op == state.head->request.ops.size()) {
      error = CompleteHead(state);
      if (!error.ok()) break;
    }
  }
  ReaderExited(state, error);
}

bool ClientConnection::NextInFlight(ReaderState& state) {
  if (state.head != nullptr) return true;
  MutexLock lock(&mu_);
  while (closed_.ok() && in_flight_.empty()) reader_cv_.Wait(&mu_);
  if (!closed_.ok()) return false;
  state.head = in_flight_.front();
  state.op = 0;
  state.head_cancelled = false;
  return true;
}

absl::Status ClientConnection::ReadResponse(HeaderReader& reader, ReaderState& state) {
  absl::StatusOr<const std::byte*> raw = reader.Next();
  if (!raw.ok()) {
    return absl::UnavailableError(
        absl::StrCat("tcp connection to ", endpoint_, " lost: ", raw.status().message()));
  }
  wire::ResponseHeader h;
  if (absl::Status s = wire::DecodeResponse(*raw, &h); !s.ok()) {
    return absl::DataLossError(
        absl::StrCat("tcp protocol error from ", endpoint_, ": ", s.message()));
  }
  if (h.code != 0) return ReadErrorResponse(reader, h, state);
  const Pending& head = *state.head;
  const uint64_t expected_seq = head.first_seq + state.op;
  const WireOp& wop = head.request.ops[state.op];
  const bool read = head.request.kind == OpKind::kRead;
  const uint64_t payload = read ? wop.length : 0;
  if (h.sequence != expected_seq || h.kind != wire::WireKind(head.request.kind) ||
      h.payload_len != payload) {
    return absl::DataLossError(absl::StrCat(
        "tcp protocol error from ", endpoint_, ": response seq ", h.sequence, " kind ",
        wire::WireKindName(h.kind), " payload ", h.payload_len, ", expected seq ", expected_seq,
        " kind ", wire::WireKindName(wire::WireKind(head.request.kind)), " payload ", payload,
        " (transfer ", head.request.transfer_id, " op ", state.op, ")"));
  }
  if (absl::Status s = reader.Expect(payload, h.follow); !s.ok()) {
    return absl::DataLossError(
        absl::StrCat("tcp protocol error from ", endpoint_, ": ", s.message()));
  }
  if (payload == 0) return absl::OkStatus();
  return ReceiveReadPayload(reader, wop, payload, state);
}

absl::Status ClientConnection::ReadErrorResponse(HeaderReader& reader,
                                                 const tcp_wire::ResponseHeader& h,
                                                 ReaderState& state) {
  // The target refused an op (or our stream); it closes the connection after this.
  std::string message(h.message_len, '\0');
  absl::Status s = reader.Expect(h.message_len, 0);
  if (s.ok()) {
    s = reader.ReadTrailing(reinterpret_cast<std::byte*>(message.data()), message.size());
  }
  if (!s.ok()) message = absl::StrCat("(message lost: ", s.message(), ")");
  const absl::StatusCode code = wire::CodeFromWire(h.code);
  const Pending& head = *state.head;
  if (h.sequence != head.first_seq + state.op) {
    return absl::Status(
        code, absl::StrCat("tcp target ", endpoint_, " reported a protocol error: ", message));
  }
  const WireOp& wop = head.request.ops[state.op];
  state.head_error = absl::Status(
      code, absl::StrCat("transfer ", head.request.transfer_id, " op ", state.op, " (",
                         wire::WireKindName(wire::WireKind(head.request.kind)), " remote region ",
                         wop.remote_region, " offset ", wop.remote_offset, " length ", wop.length,
                         ") failed at tcp target ", endpoint_, ": ", message));
  return absl::Status(code, absl::StrCat("tcp connection to ", endpoint_,
                                         " closed by the target after an error: ", message));
}

absl::Status ClientConnection::ReceiveReadPayload(HeaderReader& reader, const WireOp& wop,
                                                  uint64_t payload, ReaderState& state) {
  const Pending& head = *state.head;
  absl::Status s;
  // Once the engine ended the transfer, its local memory is no longer ours to write.
  state.head_cancelled = state.head_cancelled || Cancelled(head);
  if (state.head_cancelled) {
    s = reader.DiscardTrailing(payload);
  } else if (wop.local_gpu_device >= 0) {
    // Device memory: through the staging buffers (CompleteHead waits for the last copies).
    s = staged_in_.Receive(reader, wop.local_gpu_device, wop.local, payload,
                           head.request.cancelled.get());
  } else {
    s = reader.ReadTrailing(wop.local, payload, head.request.cancelled.get());
  }
  if (absl::IsCancelled(s)) {
    state.head_cancelled = true;  // the engine ended it mid-payload; the stream is still in sync
    s = absl::OkStatus();
  }
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("tcp connection to ", endpoint_, " lost: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status ClientConnection::CompleteHead(ReaderState& state) {
  if (staged_in_.has_work()) {
    // The READ completes only once its last bytes reached the device.
    absl::Status s = staged_in_.Drain();
    if (absl::IsCancelled(s)) {
      state.head_cancelled = true;
    } else if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("tcp connection to ", endpoint_, ": ", s.message()));
    }
  }
  const std::shared_ptr<Pending> head = std::move(state.head);
  const absl::Status result =
      state.head_cancelled || Cancelled(*head)
          ? absl::CancelledError(absl::StrCat("transfer ", head->request.transfer_id,
                                              " was cancelled; its tcp responses were "
                                              "discarded"))
          : absl::OkStatus();
  bool complete_now = false;
  {
    MutexLock lock(&mu_);
    in_flight_.pop_front();
    head->acked = true;
    head->result = result;
    complete_now = head->released;  // else the writer completes it when its send returns
  }
  if (complete_now) Complete(*head, result);
  return absl::OkStatus();
}

void ClientConnection::ReaderExited(const ReaderState& state, const absl::Status& error) {
  if (!error.ok()) Fail(error);
  // Copies into the device memory of requests about to fail must end before they do.
  if (absl::Status s = staged_in_.Abandon(); !s.ok()) {
    KVW_LOG(kError, "tcp") << "staging copies failed" << Kv("endpoint", endpoint_)
                           << Kv("error", s.message());
  }
  std::deque<std::shared_ptr<Pending>> failed;
  absl::Status why;
  {
    MutexLock lock(&mu_);
    // Fail() shut the socket down, so the writer returns promptly; until it has, it may
    // still read the memory of the requests about to be failed.
    while (!writer_exited_) reader_cv_.Wait(&mu_);
    failed.swap(in_flight_);
    why = closed_;
  }
  for (const std::shared_ptr<Pending>& pending : failed) {
    Complete(*pending, pending == state.head && !state.head_error.ok() ? state.head_error
                                                                       : ForRequest(why, *pending));
  }
  exited_.fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace kvwire::transport
