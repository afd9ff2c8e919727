// ServerConnection's batch of responses to the ops it served, and its busy mark (what the
// watchdog of TcpServer reads): private to the serving of a tcp data connection
// (tcp_server_connection.cc).
#ifndef KVWIRE_TRANSPORT_TCP_TCP_SERVER_RESPONSES_H_
#define KVWIRE_TRANSPORT_TCP_TCP_SERVER_RESPONSES_H_

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "transport/tcp/tcp_gather.h"
#include "transport/tcp/tcp_reader.h"
#include "transport/tcp/tcp_server_connection.h"
#include "transport/tcp/tcp_staging.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::transport {

class ServerConnection::BusyScope {
 public:
  // Nanoseconds on the steady clock, the busy marks' unit.
  static int64_t SteadyNs(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }

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
  // Responses are sent in batches of at most this many, or as soon as they stand for this
  // many bytes (acked WRITE data or READ payload), or when the input runs dry.
  static constexpr size_t kMaxResponses = 64;
  static constexpr uint64_t kFlushBytes = 1 << 20;

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

  // `flags`/`crc`: tcp_wire's response flags (a checksum mismatch) and their CRC.
  void AddAck(uint64_t sequence, uint64_t acked_bytes, uint8_t flags = 0, uint32_t crc = 0) {
    Add(tcp_wire::kKindWrite, sequence, nullptr, 0, -1, nullptr, flags, crc);
    bytes_ += acked_bytes;
  }
  // A WRITE received through staged_in(): `pin` holds the memory until the copies ended.
  void AddStagedAck(uint64_t sequence, uint64_t acked_bytes, bool count, TransferId transfer_id,
                    std::shared_ptr<const void> pin) {
    Add(tcp_wire::kKindWrite, sequence, nullptr, 0, -1, std::move(pin));
    if (count) staged_arrivals_.push_back(transfer_id);
    staged_bytes_ += acked_bytes;
  }
  void AddRead(uint64_t sequence, const std::byte* data, uint64_t length, int device,
               std::shared_ptr<const void> pin, uint8_t flags = 0, uint32_t crc = 0) {
    Add(tcp_wire::kKindRead, sequence, data, length, device, std::move(pin), flags, crc);
    (device >= 0 ? staged_bytes_ : bytes_) += length;
  }
  bool Full() const {
    return count_ == kMaxResponses || bytes_ >= kFlushBytes || staged_bytes_ >= kStagedBatchBytes;
  }
  bool HasPending() const override { return count_ > 0; }

  // The blocking flush (PendingOutput), for the paths that block the I/O thread anyway
  // (device staging, error responses): returns once every response is sent.
  absl::Status Flush() override {
    if (count_ == 0) return absl::OkStatus();
    // The peer must take what is sent (and READ payloads stay pinned) until this returns.
    BusyScope busy(owner_, "sending responses");
    if (absl::Status s = Prepare(); !s.ok()) return s;
    // READ payloads on a device go through the staging buffers.
    const absl::Status s = gather_.Send(fd_, staged_out_);
    Finish();
    return s;
  }

  // The non-blocking flush: sends what the socket takes now; true once everything is out
  // (false: flushing() until ContinueFlush returns true). Device payloads are staged and
  // sent at once (blocking).
  absl::StatusOr<bool> StartFlush() {
    if (count_ == 0) return true;
    if (absl::Status s = Prepare(); !s.ok()) return s;
    if (gather_.staged()) {
      BusyScope busy(owner_, "sending responses");
      const absl::Status s = gather_.Send(fd_, staged_out_);
      Finish();
      if (!s.ok()) return s;
      return true;
    }
    flushing_ = true;
    return ContinueFlush();
  }
  absl::StatusOr<bool> ContinueFlush() {
    absl::StatusOr<bool> done = gather_.SendSome(fd_);
    if (!done.ok() || *done) Finish();
    return done;
  }
  bool flushing() const { return flushing_; }

 private:
  // Encodes the queued responses into the gather list (after the staged WRITEs they ack
  // reached the device).
  absl::Status Prepare() {
    if (staged_in_.has_work()) {
      // Acks (and arrival reports) of staged WRITEs only once their bytes are on the device.
      if (absl::Status s = staged_in_.Drain(); !s.ok()) return s;
    }
    for (TransferId id : staged_arrivals_) arrived_(id);
    staged_arrivals_.clear();
    uint16_t follow = 0;
    for (size_t i = count_; i-- > 0;) {
      tcp_wire::PatchFollow(headers_[i].data(), follow);
      follow = payloads_[i].length > 0 ? 1 : static_cast<uint16_t>(follow + 1);
    }
    gather_.Clear();
    for (size_t i = 0; i < count_; ++i) {
      gather_.AddHeader(headers_[i].data(), tcp_wire::kResponseBytes);
      const Payload& p = payloads_[i];
      if (p.length > 0) gather_.AddPayload(p.data, p.length, p.device);
    }
    return absl::OkStatus();
  }
  // The responses are sent (or failed): the READ payloads are no longer read.
  void Finish() {
    for (size_t i = 0; i < count_; ++i) pins_[i].reset();
    count_ = 0;
    bytes_ = 0;
    staged_bytes_ = 0;
    flushing_ = false;
  }

 public:
  // The connection ends: waits for the copies of staged WRITEs, then releases every pin.
  absl::Status Abandon() {
    absl::Status s = staged_in_.Abandon();
    for (size_t i = 0; i < count_; ++i) pins_[i].reset();
    count_ = 0;
    flushing_ = false;
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
           std::shared_ptr<const void> pin, uint8_t flags = 0, uint32_t crc = 0) {
    tcp_wire::ResponseHeader h;
    h.kind = kind;
    h.flags = flags;
    h.crc = crc;
    h.sequence = sequence;
    h.payload_len = length;
    tcp_wire::EncodeResponse(h, headers_[count_].data());
    payloads_[count_] = {data, length, device};
    pins_[count_] = std::move(pin);
    ++count_;
  }

  ServerConnection* const owner_;
  const int fd_;
  std::vector<std::array<std::byte, tcp_wire::kResponseBytes>> headers_;
  std::vector<Payload> payloads_;
  std::vector<std::shared_ptr<const void>> pins_;
  GatherList gather_;
  size_t count_ = 0;
  bool flushing_ = false;      // a non-blocking flush is under way (nothing may be added)
  uint64_t bytes_ = 0;         // host payload and acked host bytes
  uint64_t staged_bytes_ = 0;  // staged READ payload and staged acked bytes
  std::vector<TransferId> staged_arrivals_;
  const std::function<void(TransferId)> arrived_;
  StagedSender staged_out_;
  // Declared last: destroyed first, so its copies end before the pins are released.
  StagedReceiver staged_in_;
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_SERVER_RESPONSES_H_
