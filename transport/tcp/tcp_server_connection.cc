#include "transport/tcp/tcp_server_connection.h"

#include <algorithm>
#include <array>
#include <functional>
#include <optional>
#include <pthread.h>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/log.h"
#include "transport/tcp/tcp_gather.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {
namespace {

namespace wire = tcp_wire;

// After an error response, input is discarded for at most this long / this many bytes.
constexpr absl::Duration kLingerTime = absl::Seconds(2);
constexpr uint64_t kLingerBytes = 256 << 20;
// Responses are sent in batches of at most this many, or as soon as they stand for this many
// bytes (acked WRITE data or READ payload), or when the input runs dry.
constexpr size_t kMaxResponses = 64;
constexpr uint64_t kFlushBytes = 1 << 20;

int64_t SteadyNs(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

class ServerConnection::BusyScope {
 public:
  BusyScope(ServerConnection* c, const char* what)
      : c_(c), outer_(c->busy_since_ns_.load(std::memory_order_relaxed) == 0) {
    if (!outer_) return;
    c_->busy_what_.store(what, std::memory_order_relaxed);
    // At least 1: 0 means "not busy".
    c_->busy_since_ns_.store(std::max<int64_t>(1, SteadyNs(std::chrono::steady_clock::now())),
                             std::memory_order_release);
  }
  ~BusyScope() {
    if (outer_) c_->busy_since_ns_.store(0, std::memory_order_release);
  }
  BusyScope(const BusyScope&) = delete;
  BusyScope& operator=(const BusyScope&) = delete;

 private:
  ServerConnection* const c_;
  const bool outer_;
};

// Responses queued for one gather send: headers in one contiguous array (so that runs of
// acks go out as one iovec), READ payloads referenced in place and pinned until sent. With
// device memory: READ payloads are staged on the way out, and the acks of WRITEs received
// through `staged_in` wait (like their arrival reports) until its copies ended.
class ServerConnection::Responses final : public PendingOutput {
 public:
  Responses(ServerConnection* owner, int fd, const GpuStaging& staging,
            std::function<void(TransferId)> arrived)
      : owner_(owner),
        fd_(fd),
        headers_(kMaxResponses),
        payloads_(kMaxResponses),
        pins_(kMaxResponses),
        arrived_(std::move(arrived)),
        staged_out_(staging),
        staged_in_(staging) {
    gather_.Reserve(2 * kMaxResponses);
  }
  // Copies still running may write memory that the pins hold.
  ~Responses() { (void)Abandon(); }

  StagedReceiver& staged_in() { return staged_in_; }

  void AddAck(uint64_t sequence, uint64_t acked_bytes) {
    Add(wire::kKindWrite, sequence, nullptr, 0, -1, nullptr);
    bytes_ += acked_bytes;
  }
  // A WRITE received through staged_in(): `pin` holds the memory until the copies ended.
  void AddStagedAck(uint64_t sequence, uint64_t acked_bytes, bool count, TransferId transfer_id,
                    std::shared_ptr<const void> pin) {
    Add(wire::kKindWrite, sequence, nullptr, 0, -1, std::move(pin));
    if (count) staged_arrivals_.push_back(transfer_id);
    staged_bytes_ += acked_bytes;
  }
  void AddRead(uint64_t sequence, const std::byte* data, uint64_t length, int device,
               std::shared_ptr<const void> pin) {
    Add(wire::kKindRead, sequence, data, length, device, std::move(pin));
    (device >= 0 ? staged_bytes_ : bytes_) += length;
  }
  bool Full() const {
    return count_ == kMaxResponses || bytes_ >= kFlushBytes || staged_bytes_ >= kStagedBatchBytes;
  }
  bool HasPending() const override { return count_ > 0; }

  absl::Status Flush() override {
    if (count_ == 0) return absl::OkStatus();
    // The peer must take what is sent (and READ payloads stay pinned) until this returns.
    BusyScope busy(owner_, "sending responses");
    if (staged_in_.has_work()) {
      // Acks (and arrival reports) of staged WRITEs only once their bytes are on the device.
      if (absl::Status s = staged_in_.Drain(); !s.ok()) return s;
    }
    for (TransferId id : staged_arrivals_) arrived_(id);
    staged_arrivals_.clear();
    uint16_t follow = 0;
    for (size_t i = count_; i-- > 0;) {
      wire::PatchFollow(headers_[i].data(), follow);
      follow = payloads_[i].length > 0 ? 1 : static_cast<uint16_t>(follow + 1);
    }
    gather_.Clear();
    for (size_t i = 0; i < count_; ++i) {
      gather_.AddHeader(headers_[i].data(), wire::kResponseBytes);
      const Payload& p = payloads_[i];
      if (p.length > 0) gather_.AddPayload(p.data, p.length, p.device);
    }
    // READ payloads on a device go through the staging buffers.
    const absl::Status s = gather_.Send(fd_, staged_out_);
    for (size_t i = 0; i < count_; ++i) pins_[i].reset();
    count_ = 0;
    bytes_ = 0;
    staged_bytes_ = 0;
    return s;
  }

  // The connection ends: waits for the copies of staged WRITEs, then releases every pin.
  absl::Status Abandon() {
    absl::Status s = staged_in_.Abandon();
    for (size_t i = 0; i < count_; ++i) pins_[i].reset();
    count_ = 0;
    staged_arrivals_.clear();
    return s;
  }

 private:
  struct Payload {
    const std::byte* data = nullptr;
    uint64_t length = 0;
    int device = -1;
  };

  void Add(uint8_t kind, uint64_t sequence, const std::byte* data, uint64_t length, int device,
           std::shared_ptr<const void> pin) {
    wire::ResponseHeader h;
    h.kind = kind;
    h.sequence = sequence;
    h.payload_len = length;
    wire::EncodeResponse(h, headers_[count_].data());
    payloads_[count_] = {data, length, device};
    pins_[count_] = std::move(pin);
    ++count_;
  }

  ServerConnection* const owner_;
  const int fd_;
  std::vector<std::array<std::byte, wire::kResponseBytes>> headers_;
  std::vector<Payload> payloads_;
  std::vector<std::shared_ptr<const void>> pins_;
  GatherList gather_;
  size_t count_ = 0;
  uint64_t bytes_ = 0;         // host payload and acked host bytes
  uint64_t staged_bytes_ = 0;  // staged READ payload and staged acked bytes
  std::vector<TransferId> staged_arrivals_;
  const std::function<void(TransferId)> arrived_;
  StagedSender staged_out_;
  // Declared last: destroyed first, so its copies end before the pins are released.
  StagedReceiver staged_in_;
};

ServerConnection::ServerConnection(std::unique_ptr<Socket> socket, std::string remote, PeerId peer,
                                   TargetHooks* hooks, uint64_t max_op_bytes, GpuStaging staging)
    : socket_(std::move(socket)),
      remote_(std::move(remote)),
      peer_(peer),
      hooks_(hooks),
      max_op_bytes_(max_op_bytes),
      staging_(std::move(staging)) {}

ServerConnection::~ServerConnection() {
  Stop();
  Join();
}

absl::Status ServerConnection::Start() {
  try {
    thread_ = std::thread([this] { Run(); });
  } catch (const std::system_error& e) {
    // E.g. EAGAIN at the process's thread limit: this connection is refused, nothing else.
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start a thread to serve the connection: ", e.what()));
  }
  return absl::OkStatus();
}

void ServerConnection::Stop() {
  stopped_.store(true, std::memory_order_release);
  socket_->Shutdown();
}

bool ServerConnection::Expire(std::string reason) {
  {
    MutexLock lock(&mu_);
    if (!expired_.empty()) return false;
    expired_ = std::move(reason);
  }
  socket_->Shutdown();
  return true;
}

void ServerConnection::Join() {
  if (thread_.joinable()) thread_.join();
}

absl::Duration ServerConnection::BusyFor(std::chrono::steady_clock::time_point now,
                                         const char** what) const {
  const int64_t since = busy_since_ns_.load(std::memory_order_acquire);
  *what = busy_what_.load(std::memory_order_relaxed);
  if (since == 0) return absl::ZeroDuration();
  return absl::Nanoseconds(std::max<int64_t>(0, SteadyNs(now) - since));
}

void ServerConnection::Run() {
  pthread_setname_np(pthread_self(), "kvw-tcp-serve");
  wire::HelloReply reply;
  reply.code = 0;
  reply.max_op_bytes = max_op_bytes_;
  std::array<std::byte, wire::kHelloReplyBytes> out;
  wire::EncodeHelloReply(reply, out.data());
  absl::Status sent;
  {
    BusyScope busy(this, "sending the hello reply");
    sent = SendAll(socket_->fd(), out.data(), out.size());
  }
  if (sent.ok()) {
    Serve();
  } else {
    KVW_LOG(kWarning, "tcp") << "data connection lost before it was served" << Kv("remote", remote_)
                             << Kv("peer", peer_) << Kv("error", sent.message());
  }
  socket_->Close();
  exited_.store(true, std::memory_order_release);
}

// One op the peer sent, validated and resolved to the engine's memory (`access` pins it).
struct ServerConnection::IncomingOp {
  wire::RequestHeader header;
  IncomingAccess access;
  bool write = false;
  bool staged = false;  // device memory: through the staging buffers
  bool count = false;   // a WRITE the engine counts as arrived
};

void ServerConnection::Serve() {
  const PeerId peer = peer_;
  const int fd = socket_->fd();
  Responses responses(this, fd, staging_,
                      [this, peer](TransferId id) { hooks_->OnWriteArrived(peer, id); });
  HeaderReader reader(fd, wire::kRequestBytes, &responses);
  const std::string context =
      absl::StrCat("tcp data connection from ", remote_, " (peer ", peer, ")");
  uint64_t expected_seq = 0;
  absl::Status io;  // why the stream ended, when it did by itself

  while (true) {
    absl::StatusOr<const std::byte*> raw = reader.Next();
    if (!raw.ok()) {
      io = raw.status();
      break;
    }
    std::optional<IncomingOp> op = AcceptOp(*raw, expected_seq, reader, responses, context);
    if (!op.has_value()) return;  // refused: the error was answered and reported
    if (absl::Status s = ServeOp(*op, reader, responses); !s.ok()) {
      io = s;
      break;
    }
    if (responses.Full()) {
      if (absl::Status s = responses.Flush(); !s.ok()) {
        io = s;
        break;
      }
    }
  }
  EndServing(responses, io, context);
}

std::optional<ServerConnection::IncomingOp> ServerConnection::AcceptOp(const std::byte* raw,
                                                                       uint64_t& expected_seq,
                                                                       HeaderReader& reader,
                                                                       Responses& responses,
                                                                       const std::string& context) {
  IncomingOp op;
  wire::RequestHeader& h = op.header;
  if (absl::Status s = wire::DecodeRequest(raw, max_op_bytes_, &h); !s.ok()) {
    RefuseOp(responses, wire::kNoSequence,
             absl::InvalidArgumentError(absl::StrCat("protocol error: ", s.message())), context);
    return std::nullopt;
  }
  if (h.sequence != expected_seq) {
    RefuseOp(responses, wire::kNoSequence,
             absl::InvalidArgumentError(absl::StrCat("protocol error: op sequence ", h.sequence,
                                                     ", expected ", expected_seq)),
             context);
    return std::nullopt;
  }
  ++expected_seq;
  op.write = h.kind == wire::kKindWrite;
  absl::StatusOr<IncomingAccess> access = hooks_->ResolveIncoming(
      peer_, h.region, h.offset, h.length, op.write ? OpKind::kWrite : OpKind::kRead);
  if (!access.ok()) {
    RefuseOp(responses, h.sequence, access.status(),
             absl::StrCat(context, ": op ", h.op_index, " of transfer ", h.transfer_id));
    return std::nullopt;
  }
  if (access->data == nullptr && h.length > 0) {
    RefuseOp(
        responses, h.sequence,
        absl::InternalError(absl::StrCat("remote region ", h.region, " resolved to no memory")),
        absl::StrCat(context, ": op ", h.op_index, " of transfer ", h.transfer_id));
    return std::nullopt;
  }
  if (absl::Status s = reader.Expect(op.write ? h.length : 0, h.follow); !s.ok()) {
    RefuseOp(responses, wire::kNoSequence,
             absl::InvalidArgumentError(absl::StrCat("protocol error: ", s.message())), context);
    return std::nullopt;
  }
  op.staged = access->gpu_device >= 0 && h.length > 0;
  if (op.staged && staging_.runtime == nullptr) {
    RefuseOp(
        responses, h.sequence,
        absl::FailedPreconditionError(absl::StrCat("remote region ", h.region,
                                                   " is GPU memory and this tcp target has no GPU "
                                                   "runtime")),
        absl::StrCat(context, ": op ", h.op_index, " of transfer ", h.transfer_id));
    return std::nullopt;
  }
  op.count = (h.flags & wire::kFlagCountArrivals) != 0;
  op.access = std::move(*access);
  return op;
}

absl::Status ServerConnection::ServeOp(IncomingOp& op, HeaderReader& reader, Responses& responses) {
  const wire::RequestHeader& h = op.header;
  if (!op.write) {
    // The payload goes out with the responses (staged there when on a device), pinned until.
    responses.AddRead(h.sequence, op.access.data, h.length, op.staged ? op.access.gpu_device : -1,
                      std::move(op.access.pin));
    return absl::OkStatus();
  }
  return op.staged ? ReceiveStagedWrite(op, reader, responses)
                   : ReceiveWrite(op, reader, responses);
}

absl::Status ServerConnection::ReceiveWrite(IncomingOp& op, HeaderReader& reader,
                                            Responses& responses) {
  const wire::RequestHeader& h = op.header;
  // Straight into the engine's memory; `access` pins it meanwhile.
  absl::Status s;
  {
    BusyScope busy(this, "receiving a WRITE payload");
    s = reader.ReadTrailing(op.access.data, h.length);
  }
  if (!s.ok()) return s;
  if (op.count) hooks_->OnWriteArrived(peer_, h.transfer_id);
  responses.AddAck(h.sequence, h.length);
  return absl::OkStatus();
}

absl::Status ServerConnection::ReceiveStagedWrite(IncomingOp& op, HeaderReader& reader,
                                                  Responses& responses) {
  const wire::RequestHeader& h = op.header;
  // Through the staging buffers; acked (and counted) once on the device, pinned until then.
  absl::Status s;
  {
    BusyScope busy(this, "receiving a WRITE payload");
    s = responses.staged_in().Receive(reader, op.access.gpu_device, op.access.data, h.length,
                                      nullptr);
  }
  if (!s.ok()) return s;
  responses.AddStagedAck(h.sequence, h.length, op.count, h.transfer_id, std::move(op.access.pin));
  return absl::OkStatus();
}

void ServerConnection::EndServing(Responses& responses, const absl::Status& io,
                                  const std::string& context) {
  if (absl::Status s = responses.Abandon(); !s.ok()) {
    KVW_LOG(kError, "tcp") << "staging copies failed" << Kv("remote", remote_)
                           << Kv("error", s.message());
  }
  std::string expired;
  {
    MutexLock lock(&mu_);
    expired = expired_;
  }
  if (!expired.empty()) {
    // Every pin is released by now; the engine drops the peer and tells it why.
    const absl::Status report =
        absl::DeadlineExceededError(absl::StrCat(context, " dropped: ", expired));
    KVW_LOG(kWarning, "tcp") << "stalled data connection cut" << Kv("peer", peer_)
                             << Kv("error", report.message());
    if (!stopped_.load(std::memory_order_acquire)) hooks_->OnPeerError(peer_, report);
    return;
  }
  KVW_LOG(kInfo, "tcp") << "data connection ended" << Kv("remote", remote_) << Kv("peer", peer_)
                        << Kv("reason", io.message())
                        << Kv("stopped", stopped_.load(std::memory_order_acquire));
}

void ServerConnection::RefuseOp(Responses& responses, uint64_t sequence, const absl::Status& error,
                                const std::string& context) {
  const absl::Status report(error.code(), absl::StrCat(context, ": ", error.message()));
  KVW_LOG(kWarning, "tcp") << "refusing op stream" << Kv("peer", peer_)
                           << Kv("error", report.message());
  // Earlier ops succeeded: their responses go first, in order.
  absl::Status sent = responses.Flush();
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
    sent = SendAll(socket_->fd(), iov, 2);
  }
  if (!stopped_.load(std::memory_order_acquire)) hooks_->OnPeerError(peer_, report);
  if (sent.ok()) Linger();
}

void ServerConnection::Linger() {
  socket_->ShutdownWrite();
  const int fd = socket_->fd();
  const absl::Time until = absl::Now() + kLingerTime;
  std::vector<std::byte> sink(64 << 10);
  uint64_t drained = 0;
  while (drained < kLingerBytes && !stopped_.load(std::memory_order_acquire)) {
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration() || !SetIoTimeout(fd, left).ok()) break;
    iovec iov{sink.data(), sink.size()};
    absl::StatusOr<size_t> n = RecvSome(fd, &iov, 1, RecvMode::kSome);
    if (!n.ok()) break;  // end of stream (the peer read the error and closed), or timeout
    drained += *n;
  }
}

}  // namespace kvwire::transport
