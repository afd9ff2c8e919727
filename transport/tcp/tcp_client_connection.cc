#include "transport/tcp/tcp_client_connection.h"

#include <algorithm>
#include <array>
#include <pthread.h>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
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

void ClientConnection::WriterLoop() {
  pthread_setname_np(pthread_self(), "kvw-tcp-send");
  struct Slot {
    const Pending* pending;
    uint32_t op;
  };
  std::vector<Slot> slots;
  slots.reserve(kMaxBatchOps);
  std::vector<std::array<std::byte, wire::kRequestBytes>> headers(kMaxBatchOps);
  std::vector<iovec> iov;
  iov.reserve(2 * kMaxBatchOps);
  // The same batch when a payload lies in device memory (sent through the staging buffers).
  std::vector<StagedSender::Piece> pieces;
  pieces.reserve(2 * kMaxBatchOps);
  // The requests of the current batch: kept alive (ops, pins) while their bytes are sent.
  std::vector<std::shared_ptr<Pending>> holds;
  holds.reserve(kMaxBatchOps);
  std::shared_ptr<Pending> current;  // a request whose ops did not all fit in one batch
  uint32_t next_op = 0;

  while (true) {
    slots.clear();
    holds.clear();
    uint64_t batch_bytes = 0;
    {
      MutexLock lock(&mu_);
      while (closed_.ok() && current == nullptr && to_send_.empty()) writer_cv_.Wait(&mu_);
      if (!closed_.ok()) break;
      while (slots.size() < kMaxBatchOps && batch_bytes < kMaxBatchBytes) {
        if (current == nullptr) {
          if (to_send_.empty()) break;
          current = std::move(to_send_.front());
          to_send_.pop_front();
          // In flight before its first byte is sent, so the reader expects its responses.
          current->first_seq = next_seq_;
          next_seq_ += current->request.ops.size();
          // The writer never touches a READ's local memory: nothing to wait for.
          current->released = current->request.kind == OpKind::kRead;
          in_flight_.push_back(current);
          reader_cv_.Signal();
          next_op = 0;
        }
        holds.push_back(current);
        const std::vector<WireOp>& ops = current->request.ops;
        const bool write = current->request.kind == OpKind::kWrite;
        while (next_op < ops.size() && slots.size() < kMaxBatchOps &&
               batch_bytes < kMaxBatchBytes) {
          slots.push_back({current.get(), next_op});
          batch_bytes += write ? ops[next_op].length : 0;
          ++next_op;
        }
        if (next_op == ops.size()) current.reset();
      }
    }

    // Headers back to front: `follow` counts the headers after an op's payload up to and
    // including the next one that carries a payload.
    uint16_t follow = 0;
    for (size_t i = slots.size(); i-- > 0;) {
      const Pending& p = *slots[i].pending;
      const WireOp& op = p.request.ops[slots[i].op];
      const bool write = p.request.kind == OpKind::kWrite;
      wire::RequestHeader h;
      h.kind = wire::WireKind(p.request.kind);
      h.flags = write && p.request.count_arrivals ? wire::kFlagCountArrivals : 0;
      h.follow = follow;
      h.op_index = slots[i].op;
      h.sequence = p.first_seq + slots[i].op;
      h.transfer_id = p.request.transfer_id;
      h.region = op.remote_region;
      h.offset = op.remote_offset;
      h.length = op.length;
      wire::EncodeRequest(h, headers[i].data());
      const bool has_payload = write && op.length > 0;
      follow = has_payload ? 1 : static_cast<uint16_t>(std::min<int>(follow + 1, wire::kMaxFollow));
    }
    iov.clear();
    pieces.clear();
    bool staged = false;
    for (const Slot& slot : slots) {
      const WireOp& op = slot.pending->request.ops[slot.op];
      staged = staged || (slot.pending->request.kind == OpKind::kWrite && op.length > 0 &&
                          op.local_gpu_device >= 0);
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      std::byte* header = headers[i].data();
      // Adjacent headers (READs) share one iovec: the header array is contiguous.
      if (!iov.empty() &&
          static_cast<std::byte*>(iov.back().iov_base) + iov.back().iov_len == header) {
        iov.back().iov_len += wire::kRequestBytes;
      } else {
        iov.push_back({header, wire::kRequestBytes});
      }
      const Pending& p = *slots[i].pending;
      const WireOp& op = p.request.ops[slots[i].op];
      if (p.request.kind == OpKind::kWrite && op.length > 0) {
        if (staged) {
          for (const iovec& v : iov) {
            pieces.push_back({static_cast<const std::byte*>(v.iov_base), v.iov_len, -1});
          }
          iov.clear();
          pieces.push_back({op.local, op.length, op.local_gpu_device});
        } else {
          iov.push_back({op.local, op.length});
        }
      }
    }
    absl::Status sent;
    if (staged) {
      for (const iovec& v : iov) {
        pieces.push_back({static_cast<const std::byte*>(v.iov_base), v.iov_len, -1});
      }
      // When this returns, no copy reads the batch's device memory any more.
      sent = staged_out_.Send(socket_->fd(), pieces);
    } else {
      sent = SendAll(socket_->fd(), iov.data(), iov.size());
    }
    for (const std::shared_ptr<Pending>& pending : Release(holds, current.get())) {
      Complete(*pending, pending->result);
    }
    if (!sent.ok()) {
      Fail(absl::UnavailableError(
          absl::StrCat("tcp connection to ", endpoint_, " lost: ", sent.message())));
      break;
    }
  }

  {
    // Every batch was released after its send; only a partly sent request may remain, and it
    // cannot be acked. The reader fails what is left once it sees writer_exited_.
    MutexLock lock(&mu_);
    for (const std::shared_ptr<Pending>& pending : in_flight_) pending->released = true;
    if (current != nullptr) current->released = true;
    writer_exited_ = true;
    reader_cv_.SignalAll();
  }
  exited_.fetch_add(1, std::memory_order_acq_rel);
}

void ClientConnection::ReaderLoop() {
  pthread_setname_np(pthread_self(), "kvw-tcp-recv");
  HeaderReader reader(socket_->fd(), wire::kResponseBytes, /*output=*/nullptr);
  std::shared_ptr<Pending> head;
  uint32_t op = 0;
  bool head_cancelled = false;
  absl::Status error;       // why this loop failed the connection, if it did
  absl::Status head_error;  // the target's error for `head`, if it sent one

  while (true) {
    if (head == nullptr) {
      MutexLock lock(&mu_);
      while (closed_.ok() && in_flight_.empty()) reader_cv_.Wait(&mu_);
      if (!closed_.ok()) break;
      head = in_flight_.front();
      op = 0;
      head_cancelled = false;
    }
    absl::StatusOr<const std::byte*> raw = reader.Next();
    if (!raw.ok()) {
      error = absl::UnavailableError(
          absl::StrCat("tcp connection to ", endpoint_, " lost: ", raw.status().message()));
      break;
    }
    wire::ResponseHeader h;
    if (absl::Status s = wire::DecodeResponse(*raw, &h); !s.ok()) {
      error = absl::DataLossError(
          absl::StrCat("tcp protocol error from ", endpoint_, ": ", s.message()));
      break;
    }
    const uint64_t expected_seq = head->first_seq + op;
    if (h.code != 0) {
      // The target refused an op (or our stream); it closes the connection after this.
      std::string message(h.message_len, '\0');
      absl::Status s = reader.Expect(h.message_len, 0);
      if (s.ok()) {
        s = reader.ReadTrailing(reinterpret_cast<std::byte*>(message.data()), message.size());
      }
      if (!s.ok()) message = absl::StrCat("(message lost: ", s.message(), ")");
      const absl::StatusCode code = wire::CodeFromWire(h.code);
      if (h.sequence == expected_seq) {
        const WireOp& wop = head->request.ops[op];
        head_error = absl::Status(
            code, absl::StrCat("transfer ", head->request.transfer_id, " op ", op, " (",
                               wire::WireKindName(h.kind), " remote region ", wop.remote_region,
                               " offset ", wop.remote_offset, " length ", wop.length,
                               ") failed at tcp target ", endpoint_, ": ", message));
        error = absl::Status(code, absl::StrCat("tcp connection to ", endpoint_,
                                                " closed by the target after an error: ", message));
      } else {
        error = absl::Status(
            code, absl::StrCat("tcp target ", endpoint_, " reported a protocol error: ", message));
      }
      break;
    }
    const WireOp& wop = head->request.ops[op];
    const bool read = head->request.kind == OpKind::kRead;
    const uint64_t payload = read ? wop.length : 0;
    if (h.sequence != expected_seq || h.kind != wire::WireKind(head->request.kind) ||
        h.payload_len != payload) {
      error = absl::DataLossError(absl::StrCat(
          "tcp protocol error from ", endpoint_, ": response seq ", h.sequence, " kind ",
          wire::WireKindName(h.kind), " payload ", h.payload_len, ", expected seq ", expected_seq,
          " kind ", wire::WireKindName(wire::WireKind(head->request.kind)), " payload ", payload,
          " (transfer ", head->request.transfer_id, " op ", op, ")"));
      break;
    }
    if (absl::Status s = reader.Expect(payload, h.follow); !s.ok()) {
      error = absl::DataLossError(
          absl::StrCat("tcp protocol error from ", endpoint_, ": ", s.message()));
      break;
    }
    if (payload > 0) {
      absl::Status s;
      // Once the engine ended the transfer, its local memory is no longer ours to write.
      head_cancelled = head_cancelled || Cancelled(*head);
      if (head_cancelled) {
        s = reader.DiscardTrailing(payload);
      } else if (wop.local_gpu_device >= 0) {
        s = staged_in_.Receive(reader, wop.local_gpu_device, wop.local, payload,
                               head->request.cancelled.get());
      } else {
        s = reader.ReadTrailing(wop.local, payload, head->request.cancelled.get());
      }
      if (absl::IsCancelled(s)) {
        head_cancelled = true;  // the engine ended it mid-payload; the stream is still in sync
        s = absl::OkStatus();
      }
      if (!s.ok()) {
        error = absl::UnavailableError(
            absl::StrCat("tcp connection to ", endpoint_, " lost: ", s.message()));
        break;
      }
    }
    if (++op == head->request.ops.size()) {
      if (staged_in_.has_work()) {
        // The READ completes only once its last bytes reached the device.
        absl::Status s = staged_in_.Drain();
        if (absl::IsCancelled(s)) {
          head_cancelled = true;
        } else if (!s.ok()) {
          error = absl::Status(s.code(),
                               absl::StrCat("tcp connection to ", endpoint_, ": ", s.message()));
          break;
        }
      }
      const absl::Status result =
          head_cancelled || Cancelled(*head)
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
      head.reset();
    }
  }

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
    Complete(*pending,
             pending == head && !head_error.ok() ? head_error : ForRequest(why, *pending));
  }
  exited_.fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace kvwire::transport
