#include "transport/tcp/tcp_server_connection.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/crc32c.h"
#include "src/util/fault_injection.h"
#include "src/util/log.h"
#include "transport/region_moving.h"
#include "transport/tcp/tcp_gather.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_server_responses.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;
static_assert(wire::kRequestBytes == 64, "ServerConnection::parked_ holds one request header");

// After an error response, input is discarded for at most this long / this many bytes.
constexpr absl::Duration kLingerTime = absl::Seconds(2);
constexpr uint64_t kLingerBytes = 256 << 20;

// One turn of a connection on its I/O thread moves at most about this much before the thread
// serves the other connections (and comes back to this one).
constexpr uint64_t kTurnBytes = 16 << 20;
// How long Join waits for the I/O thread to let go of the connection.
constexpr absl::Duration kJoinWait = absl::Seconds(60);

}  // namespace

ServerConnection::ServerConnection(std::unique_ptr<Socket> socket, std::string remote, PeerId peer,
                                   TargetHooks* hooks, uint64_t max_op_bytes, GpuStaging staging,
                                   std::shared_ptr<IoPool> pool)
    : socket_(std::move(socket)),
      remote_(std::move(remote)),
      peer_(peer),
      hooks_(hooks),
      max_op_bytes_(max_op_bytes),
      staging_(std::move(staging)),
      pool_(std::move(pool)),
      context_(absl::StrCat("tcp data connection from ", remote_, " (peer ", peer_, ")")) {
  responses_ = std::make_unique<Responses>(
      this, socket_->fd(), staging_, [this](TransferId id) { hooks_->OnWriteArrived(peer_, id); });
  reader_ = std::make_unique<HeaderReader>(socket_->fd(), wire::kRequestBytes, responses_.get());
}

ServerConnection::~ServerConnection() {
  // Only reached once no loop holds the connection (torn down there, never registered, or
  // its loop stopped): nothing else runs its I/O-thread state now.
  receiving_.reset();
  responses_.reset();  // waits for staged copies, then releases the pins
  socket_->Close();
}

absl::Status ServerConnection::Start() {
  if (absl::Status s = SetNonBlocking(socket_->fd(), true); !s.ok()) return s;
  loop_ = pool_->Pick();
  std::shared_ptr<ServerConnection> self = shared_from_this();
  const bool queued = loop_->Run([self] {
    if (absl::Status s = self->loop_->Add(self->socket_->fd(), self); !s.ok()) {
      KVW_LOG(kWarning, "tcp") << "data connection lost before it was served"
                               << Kv("remote", self->remote_) << Kv("peer", self->peer_)
                               << Kv("error", s.message());
      self->Release();
      return;
    }
    self->Pump();
  });
  if (!queued) {
    loop_ = nullptr;
    return absl::UnavailableError("the tcp transport's I/O threads stopped");
  }
  return absl::OkStatus();
}

void ServerConnection::Schedule() {
  {
    MutexLock lock(&mu_);
    if (scheduled_) return;
    scheduled_ = true;
  }
  std::shared_ptr<ServerConnection> self = weak_from_this().lock();
  if (self != nullptr && loop_ != nullptr) (void)loop_->Run([self] { self->Pump(); });
}

void ServerConnection::Stop() {
  stopped_.store(true, std::memory_order_release);
  socket_->Shutdown();
  Schedule();
}

bool ServerConnection::Expire(std::string reason) {
  {
    MutexLock lock(&mu_);
    if (!expired_.empty()) return false;
    expired_ = std::move(reason);
  }
  socket_->Shutdown();
  Schedule();
  return true;
}

void ServerConnection::Join() {
  if (loop_ == nullptr || Exited() || pool_->OnPoolThread()) return;
  MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + kJoinWait;
  while (!Exited()) {
    if (!exited_cv_.WaitUntil(&mu_, deadline) && absl::Now() >= deadline) {
      KVW_LOG(kError, "tcp") << "data connection not released by its I/O thread in time"
                             << Kv("remote", remote_) << Kv("peer", peer_);
      return;
    }
  }
}

absl::Duration ServerConnection::BusyFor(std::chrono::steady_clock::time_point now,
                                         const char** what) const {
  const int64_t since = busy_since_ns_.load(std::memory_order_acquire);
  *what = busy_what_.load(std::memory_order_relaxed);
  if (since == 0) return absl::ZeroDuration();
  return absl::Nanoseconds(std::max<int64_t>(0, BusyScope::SteadyNs(now) - since));
}

bool ServerConnection::LingerOver(std::chrono::steady_clock::time_point now) const {
  const int64_t until = linger_until_ns_.load(std::memory_order_acquire);
  return until != 0 && BusyScope::SteadyNs(now) >= until;
}

void ServerConnection::UpdateBusy(const char* what) {
  const bool busy = receiving_ != nullptr || responses_->flushing();
  if (!busy) {
    busy_since_ns_.store(0, std::memory_order_release);
  } else if (busy_since_ns_.load(std::memory_order_relaxed) == 0) {
    busy_what_.store(what, std::memory_order_relaxed);
    // At least 1: 0 means "not busy".
    busy_since_ns_.store(
        std::max<int64_t>(1, BusyScope::SteadyNs(std::chrono::steady_clock::now())),
        std::memory_order_release);
  }
}

void ServerConnection::OnIo(uint32_t /*events*/) { Pump(); }

absl::Status ServerConnection::SendHelloReply() {
  wire::HelloReply reply;
  reply.code = 0;
  reply.max_op_bytes = max_op_bytes_;
  std::array<std::byte, wire::kHelloReplyBytes> out;
  wire::EncodeHelloReply(reply, out.data());
  // 24 bytes into a fresh socket: they fit at once.
  BusyScope busy(this, "sending the hello reply");
  return SendAll(socket_->fd(), out.data(), out.size());
}

void ServerConnection::Pump() {
  // Release lets go of the loop's reference; this one keeps the connection until the end.
  const std::shared_ptr<ServerConnection> self = shared_from_this();
  {
    MutexLock lock(&mu_);
    scheduled_ = false;
  }
  if (released_) return;
  bool expired = false;
  {
    MutexLock lock(&mu_);
    expired = !expired_.empty();
  }
  if (stopped_.load(std::memory_order_acquire) || expired) {
    // Whatever is half done stays so: the memory is let go of now.
    EndServing(absl::CancelledError(expired ? "cut" : "stopped"));
    return;
  }
  if (lingering_) {
    DrainLinger();
    return;
  }
  if (!hello_sent_) {
    hello_sent_ = true;
    if (absl::Status s = SendHelloReply(); !s.ok()) {
      KVW_LOG(kWarning, "tcp") << "data connection lost before it was served"
                               << Kv("remote", remote_) << Kv("peer", peer_)
                               << Kv("error", s.message());
      Release();
      return;
    }
  }
  bool more = false;
  bool refused = false;
  const absl::Status io = Serve(&more, &refused);
  if (refused) {
    DrainLinger();
    return;
  }
  if (!io.ok()) {
    EndServing(io);
    return;
  }
  if (more) Schedule();
}

// One op the peer sent, validated and resolved to the engine's memory (`access` pins it).
struct ServerConnection::IncomingOp {
  wire::RequestHeader header;
  IncomingAccess access;
  bool write = false;
  bool staged = false;  // device memory: through the staging buffers
  bool count = false;   // a WRITE the engine counts as arrived
};

absl::Status ServerConnection::StartFlush() {
  absl::StatusOr<bool> done = responses_->StartFlush();
  UpdateBusy("sending responses");
  return done.status();
}

absl::Status ServerConnection::Serve(bool* more, bool* refused) {
  uint64_t moved = 0;
  while (true) {
    if (responses_->flushing()) {
      absl::StatusOr<bool> done = responses_->ContinueFlush();
      UpdateBusy("sending responses");
      if (!done.ok()) return done.status();
      if (!*done) return absl::OkStatus();  // the socket is full: EPOLLOUT brings us back
    }
    if (moved >= kTurnBytes) {
      *more = true;
      return absl::OkStatus();
    }
    if (receiving_ != nullptr) {
      // A WRITE's payload, straight into the engine's memory (`access` pins it meanwhile).
      IncomingOp& op = *receiving_;
      const size_t before = received_;
      absl::StatusOr<bool> done =
          reader_->TryReadTrailing(op.access.data, op.header.length, &received_);
      if (!done.ok()) return done.status();
      moved += received_ - before;
      if (!*done) {
        // Only wait for more input after the queued responses are on their way: the peer
        // may be waiting for them.
        return responses_->HasPending() ? StartFlush() : absl::OkStatus();
      }
      const wire::RequestHeader h = op.header;
      const bool count = op.count;
      std::unique_ptr<IncomingOp> finished = std::move(receiving_);
      UpdateBusy("");
      fault_injection::MaybeFlipPayloadByte(fault_injection::Site::kTcp, finished->access.data,
                                            h.length);
      // End to end: the CRC of the bytes where they landed against the initiator's, of its
      // source. A mismatch is answered on the ack (the op fails there with DataLoss) and not
      // counted as arrived, so no notification is released for corrupt data.
      const bool checked = (h.flags & wire::kFlagChecksum) != 0;
      const uint32_t landed = checked ? Crc32c(finished->access.data, h.length) : 0;
      if (checked && landed != h.crc) {
        KVW_LOG(kWarning, "tcp") << "checksum mismatch on an incoming WRITE" << Kv("peer", peer_)
                                 << Kv("transfer", h.transfer_id) << Kv("op", h.op_index)
                                 << Kv("region", h.region) << Kv("offset", h.offset)
                                 << Kv("length", h.length);
        responses_->AddAck(h.sequence, h.length, wire::kResponseFlagChecksumMismatch, landed);
      } else {
        if (count) hooks_->OnWriteArrived(peer_, h.transfer_id);
        responses_->AddAck(h.sequence, h.length);
      }
      finished.reset();  // the pin: the memory is written
    } else {
      const std::byte* raw = parked_.has_value() ? parked_->data() : nullptr;
      if (raw == nullptr) {
        absl::StatusOr<const std::byte*> next = reader_->TryNext();
        if (!next.ok()) return next.status();
        if (*next == nullptr) return responses_->HasPending() ? StartFlush() : absl::OkStatus();
        moved += wire::kRequestBytes;
        raw = *next;
      }
      bool parked = false;
      std::optional<IncomingOp> op = AcceptOp(raw, &parked);
      if (parked) {
        // Its region is being moved: this op (and so this stream) waits for the move, on
        // later turns; the thread serves other connections meanwhile, whose ops may hold the
        // pins the move waits for. The pause keeps the retries from spinning a core.
        if (!parked_.has_value()) {
          parked_.emplace();
          std::memcpy(parked_->data(), raw, wire::kRequestBytes);
        }
        absl::SleepFor(absl::Microseconds(50));
        *more = true;
        return responses_->HasPending() ? StartFlush() : absl::OkStatus();
      }
      parked_.reset();
      if (!op.has_value()) {
        *refused = true;  // the error was answered and reported
        return absl::OkStatus();
      }
      if (absl::Status s = ServeOp(*op); !s.ok()) return s;
    }
    if (responses_->Full()) {
      if (absl::Status s = StartFlush(); !s.ok()) return s;
    }
  }
}

std::optional<ServerConnection::IncomingOp> ServerConnection::AcceptOp(const std::byte* raw,
                                                                       bool* parked) {
  IncomingOp op;
  wire::RequestHeader& h = op.header;
  if (absl::Status s = wire::DecodeRequest(raw, max_op_bytes_, &h); !s.ok()) {
    RefuseOp(wire::kNoSequence,
             absl::InvalidArgumentError(absl::StrCat("protocol error: ", s.message())), context_);
    return std::nullopt;
  }
  if (h.sequence != expected_seq_) {
    RefuseOp(wire::kNoSequence,
             absl::InvalidArgumentError(absl::StrCat("protocol error: op sequence ", h.sequence,
                                                     ", expected ", expected_seq_)),
             context_);
    return std::nullopt;
  }
  ++expected_seq_;
  op.write = h.kind == wire::kKindWrite;
  // The target's access check: every op, before any of its bytes touch memory (READs
  // buffered together are checked as one run: tcp_read_run.h).
  absl::StatusOr<IncomingAccess> access =
      op.write
          ? hooks_->ResolveIncoming(peer_, h.region, h.offset, h.length, OpKind::kWrite, h.grant)
          : read_run_.Resolve(*hooks_, peer_, h, reader_->Ahead(), max_op_bytes_);
  if (IsRegionMoving(access.status())) {
    --expected_seq_;  // the same header again, later
    *parked = true;
    return std::nullopt;
  }
  if (!access.ok()) {
    RefuseOp(h.sequence, access.status(),
             absl::StrCat(context_, ": op ", h.op_index, " of transfer ", h.transfer_id));
    return std::nullopt;
  }
  if (access->data == nullptr && h.length > 0) {
    RefuseOp(
        h.sequence,
        absl::InternalError(absl::StrCat("remote region ", h.region, " resolved to no memory")),
        absl::StrCat(context_, ": op ", h.op_index, " of transfer ", h.transfer_id));
    return std::nullopt;
  }
  if (absl::Status s = reader_->Expect(op.write ? h.length : 0, h.follow); !s.ok()) {
    RefuseOp(wire::kNoSequence,
             absl::InvalidArgumentError(absl::StrCat("protocol error: ", s.message())), context_);
    return std::nullopt;
  }
  op.staged = access->gpu_device >= 0 && h.length > 0;
  if (op.staged && staging_.runtime == nullptr) {
    RefuseOp(
        h.sequence,
        absl::FailedPreconditionError(absl::StrCat("remote region ", h.region,
                                                   " is GPU memory and this tcp target has no GPU "
                                                   "runtime")),
        absl::StrCat(context_, ": op ", h.op_index, " of transfer ", h.transfer_id));
    return std::nullopt;
  }
  op.count = (h.flags & wire::kFlagCountArrivals) != 0;
  op.access = std::move(*access);
  return op;
}

absl::Status ServerConnection::ServeOp(IncomingOp& op) {
  const wire::RequestHeader& h = op.header;
  if (!op.write) {
    // The payload goes out with the responses (staged there when on a device), pinned until.
    // The target has the bytes of a READ: their CRC goes with the response (host memory;
    // device memory is staged on the way out and not checksummed: docs/CHECKSUMS.md).
    const bool crc = (h.flags & wire::kFlagChecksum) != 0 && !op.staged;
    responses_->AddRead(h.sequence, op.access.data, h.length, op.staged ? op.access.gpu_device : -1,
                        std::move(op.access.pin), crc ? wire::kResponseFlagChecksum : 0,
                        crc ? Crc32c(op.access.data, h.length) : 0);
    return absl::OkStatus();
  }
  if (op.staged) return ReceiveStagedWrite(op);
  receiving_ = std::make_unique<IncomingOp>(std::move(op));
  received_ = 0;
  UpdateBusy("receiving a WRITE payload");
  return absl::OkStatus();
}

absl::Status ServerConnection::ReceiveStagedWrite(IncomingOp& op) {
  const wire::RequestHeader& h = op.header;
  // Through the staging buffers; acked (and counted) once on the device, pinned until then.
  absl::Status s;
  {
    BusyScope busy(this, "receiving a WRITE payload");
    s = responses_->staged_in().Receive(*reader_, op.access.gpu_device, op.access.data, h.length,
                                        nullptr);
  }
  if (!s.ok()) return s;
  responses_->AddStagedAck(h.sequence, h.length, op.count, h.transfer_id, std::move(op.access.pin));
  return absl::OkStatus();
}

void ServerConnection::EndServing(const absl::Status& io) {
  receiving_.reset();
  read_run_.Clear();
  if (absl::Status s = responses_->Abandon(); !s.ok()) {
    KVW_LOG(kError, "tcp") << "staging copies failed" << Kv("remote", remote_)
                           << Kv("error", s.message());
  }
  busy_since_ns_.store(0, std::memory_order_release);
  std::string expired;
  {
    MutexLock lock(&mu_);
    expired = expired_;
  }
  const bool stopped = stopped_.load(std::memory_order_acquire);
  // Every pin is released by now: the socket may go, and the engine may drop the peer.
  Release();
  if (!expired.empty()) {
    const absl::Status report =
        absl::DeadlineExceededError(absl::StrCat(context_, " dropped: ", expired));
    KVW_LOG(kWarning, "tcp") << "stalled data connection cut" << Kv("peer", peer_)
                             << Kv("error", report.message());
    if (!stopped) hooks_->OnPeerError(peer_, report);
    return;
  }
  KVW_LOG(kInfo, "tcp") << "data connection ended" << Kv("remote", remote_) << Kv("peer", peer_)
                        << Kv("reason", io.message()) << Kv("stopped", stopped);
}

void ServerConnection::RefuseOp(uint64_t sequence, const absl::Status& error,
                                const std::string& context) {
  const absl::Status report(error.code(), absl::StrCat(context, ": ", error.message()));
  KVW_LOG(kWarning, "tcp") << "refusing op stream" << Kv("peer", peer_)
                           << Kv("error", report.message());
  // Earlier ops succeeded: their responses go first, in order. Both sends are small or
  // bounded by the watchdog (io_timeout), which shuts the socket down.
  absl::Status sent = responses_->Flush();
  if (sent.ok()) {
    std::string message(error.message());
    message.resize(std::min<size_t>(message.size(), wire::kMaxMessageBytes));
    wire::ResponseHeader h;
    h.code = static_cast<uint32_t>(error.code());
    h.message_len = static_cast<uint32_t>(message.size());
    h.sequence = sequence;
    std::array<std::byte, wire::kResponseBytes> out;
    wire::EncodeResponse(h, out.data());
    iovec iov[2] = {{out.data(), out.size()}, {message.data(), message.size()}};
    BusyScope busy(this, "sending an error response");
    sent = SendAll(socket_->fd(), iov, 2);
  }
  (void)responses_->Abandon();
  read_run_.Clear();
  if (!stopped_.load(std::memory_order_acquire)) hooks_->OnPeerError(peer_, report);
  if (!sent.ok()) {
    Release();
    return;
  }
  // Stop sending, and discard input for a moment so that closing does not reset the
  // connection before the peer read the error (the server's watchdog ends the moment).
  socket_->ShutdownWrite();
  lingering_ = true;
  linger_until_ns_.store(
      BusyScope::SteadyNs(std::chrono::steady_clock::now()) + absl::ToInt64Nanoseconds(kLingerTime),
      std::memory_order_release);
}

void ServerConnection::DrainLinger() {
  std::array<std::byte, 16 << 10> sink;
  while (lingered_bytes_ < kLingerBytes) {
    iovec iov{sink.data(), sink.size()};
    absl::StatusOr<size_t> n = RecvSome(socket_->fd(), &iov, 1, RecvMode::kNonBlocking);
    if (!n.ok()) break;   // end of stream (the peer read the error and closed), or an error
    if (*n == 0) return;  // more later (or the watchdog ends it)
    lingered_bytes_ += *n;
  }
  Release();
}

void ServerConnection::Release() {
  if (released_) return;
  released_ = true;
  receiving_.reset();
  read_run_.Clear();
  (void)responses_->Abandon();
  busy_since_ns_.store(0, std::memory_order_release);
  linger_until_ns_.store(0, std::memory_order_release);
  if (loop_ != nullptr && loop_->OnLoopThread()) loop_->Remove(socket_->fd());
  socket_->Close();
  MutexLock lock(&mu_);
  exited_.store(true, std::memory_order_release);
  exited_cv_.SignalAll();
}

}  // namespace kvwire::transport
