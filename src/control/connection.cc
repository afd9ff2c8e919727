#include "src/control/connection.h"

#include <iterator>
#include <utility>

#include <boost/asio/buffer.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>

#include "absl/strings/str_cat.h"

#include "src/control/address.h"
#include "src/control/handshake.h"
#include "src/util/log.h"

namespace kvwire::control {
namespace {

namespace asio = boost::asio;
using boost::system::error_code;

bool IsEnabled(absl::Duration d) {
  return d > absl::ZeroDuration() && d != absl::InfiniteDuration();
}

std::string RemoteAddressOf(const asio::ip::tcp::socket& socket) {
  error_code error;
  const asio::ip::tcp::endpoint endpoint = socket.remote_endpoint(error);
  if (error) return absl::StrCat("<unknown peer: ", error.message(), ">");
  return FormatEndpoint(endpoint);
}

}  // namespace

std::shared_ptr<TcpConnection> TcpConnection::Create(asio::ip::tcp::socket socket,
                                                     FrameDecoder decoder, uint32_t max_frame_bytes,
                                                     uint64_t max_send_queue_bytes,
                                                     std::shared_ptr<const void> slot) {
  std::string remote = RemoteAddressOf(socket);
  decoder.set_max_frame_bytes(max_frame_bytes);
  return std::make_shared<TcpConnection>(PrivateTag{}, std::move(socket), std::move(decoder),
                                         std::move(remote), max_send_queue_bytes, std::move(slot));
}

TcpConnection::TcpConnection(PrivateTag, asio::ip::tcp::socket socket, FrameDecoder decoder,
                             std::string remote_address, uint64_t max_send_queue_bytes,
                             std::shared_ptr<const void> slot)
    : remote_address_(std::move(remote_address)),
      max_frame_bytes_(decoder.max_frame_bytes()),
      max_send_queue_bytes_(max_send_queue_bytes),
      decoder_(std::move(decoder)),
      socket_(std::move(socket)),
      heartbeat_timer_(socket_.get_executor()),
      lease_timer_(socket_.get_executor()),
      linger_timer_(socket_.get_executor()),
      slot_(std::move(slot)) {}

void TcpConnection::Start(MessageHandler on_message, CloseHandler on_close,
                          absl::Duration heartbeat_interval, absl::Duration lease) {
  absl::Status closed_before_start;
  {
    MutexLock lock(&mu_);
    if (started_) {
      KVW_LOG(kError, "control") << "Connection::Start called twice; ignored"
                                 << Kv("peer", remote_address_);
      return;
    }
    started_ = true;
    if (closed_) {
      closed_before_start = close_status_;
    } else {
      // Published to the read chain by the post below, which happens after this write.
      on_message_ = std::move(on_message);
      on_close_ = std::move(on_close);
      last_receive_ = Clock::now();
      if (IsEnabled(heartbeat_interval)) {
        heartbeat_interval_ = absl::ToChronoNanoseconds(heartbeat_interval);
        ArmHeartbeatLocked();
      }
      if (IsEnabled(lease)) {
        lease_ = absl::ToChronoNanoseconds(lease);
        lease_duration_ = lease;
        ArmLeaseLocked(last_receive_ + lease_);
      }
      // Envelopes the handshake read ahead must reach the handler before anything read
      // later, and on an io_context thread.
      asio::post(socket_.get_executor(), [self = Self()] { self->OnStart(); });
      return;
    }
  }
  if (on_close) on_close(closed_before_start);
}

absl::Status TcpConnection::Send(const pb::Envelope& message) {
  absl::StatusOr<std::string> frame = EncodeFrame(message, max_frame_bytes_);
  if (!frame.ok()) {
    return absl::Status(frame.status().code(),
                        absl::StrCat("cannot send ", MessageName(message), " to ", remote_address_,
                                     ": ", frame.status().message()));
  }
  absl::Status overflow;
  {
    MutexLock lock(&mu_);
    if (closed_) {
      return absl::FailedPreconditionError(absl::StrCat("connection to ", remote_address_,
                                                        " is closed: ", close_status_.ToString()));
    }
    if (queued_bytes_ + frame->size() <= max_send_queue_bytes_) {
      queued_bytes_ += frame->size();
      send_queue_.push_back(*std::move(frame));
      StartWriteLocked();
      return absl::OkStatus();
    }
    // The peer is not reading (or far slower than we send): holding more would let it grow
    // this process's memory without bound.
    overflow = absl::ResourceExhaustedError(absl::StrCat(
        "peer ", remote_address_, " is not reading its control channel: ", queued_bytes_,
        " bytes already queued, ", MessageName(message), " of ", frame->size(),
        " bytes would exceed the send queue limit of ", max_send_queue_bytes_, " bytes"));
  }
  KVW_LOG(kWarning, "control") << "closing a peer that does not read" << Kv("peer", remote_address_)
                               << Kv("error", overflow.message());
  CloseWith(overflow, /*send_goodbye=*/true);
  return overflow;
}

void TcpConnection::Close(const absl::Status& reason) { CloseWith(reason, /*send_goodbye=*/true); }

void TcpConnection::CloseWith(const absl::Status& status, bool send_goodbye) {
  CloseHandler handler;
  {
    MutexLock lock(&mu_);
    if (closed_) return;
    closed_ = true;
    close_status_ = status;
    handler = std::move(on_close_);
    on_close_ = nullptr;
    heartbeat_timer_.cancel();
    lease_timer_.cancel();
    if (send_goodbye && socket_.is_open()) {
      pb::Envelope goodbye;
      goodbye.mutable_goodbye()->set_code(static_cast<uint32_t>(status.code()));
      goodbye.mutable_goodbye()->set_reason(status.message().empty()
                                                ? std::string("connection closed")
                                                : std::string(status.message()));
      absl::StatusOr<std::string> frame = EncodeFrame(goodbye, max_frame_bytes_);
      if (!frame.ok()) {
        // A reason too long for one frame: say less rather than nothing.
        goodbye.mutable_goodbye()->mutable_reason()->resize(max_frame_bytes_ / 2);
        frame = EncodeFrame(goodbye, max_frame_bytes_);
      }
      // Past the limit on purpose: one small frame, and the linger timer bounds it.
      if (frame.ok()) {
        queued_bytes_ += frame->size();
        send_queue_.push_back(*std::move(frame));
      }
      // The writer shuts down the sending side once the queue is flushed; the linger timer
      // bounds how long a peer that does not read can keep the socket open.
      linger_timer_.expires_after(absl::ToChronoNanoseconds(kGoodbyeLinger));
      linger_timer_.async_wait([self = Self()](const error_code& error) { self->OnLinger(error); });
      StartWriteLocked();
    } else {
      CloseSocketLocked();
    }
  }
  KVW_LOG(kInfo, "control") << "connection closed" << Kv("peer", remote_address_)
                            << Kv("reason", status.ToString());
  if (handler) handler(status);
}

void TcpConnection::CloseSocketLocked() {
  error_code ignored;
  if (socket_.is_open()) {
    socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }
  linger_timer_.cancel();
  // Nothing queued can be sent any more; in_flight_ is freed by the aborted write's handler.
  for (const std::string& frame : send_queue_) queued_bytes_ -= frame.size();
  send_queue_.clear();
  slot_.reset();
}

void TcpConnection::OnStart() {
  DeliverDecoded();
  // The handshake may have read a bad frame right behind its last message.
  if (!decoder_.status().ok()) {
    CloseWith(absl::Status(decoder_.status().code(),
                           absl::StrCat("protocol error from peer ", remote_address_, ": ",
                                        decoder_.status().message())),
              /*send_goodbye=*/true);
  }
  ContinueReading();
}

void TcpConnection::ContinueReading() {
  MutexLock lock(&mu_);
  if (closed_) {
    // Nothing more will be delivered; dropping the handler breaks any reference cycle
    // through captures of this connection.
    on_message_ = nullptr;
  }
  // After a local close the socket stays open while the Goodbye drains; keep reading (and
  // discarding) until the peer's EOF so that closing never resets unread data.
  if (socket_.is_open()) StartReadLocked();
}

void TcpConnection::StartReadLocked() {
  socket_.async_read_some(
      asio::buffer(read_buffer_),
      [self = Self()](const error_code& error, size_t bytes) { self->OnRead(error, bytes); });
}

void TcpConnection::OnRead(const error_code& error, size_t bytes) {
  bool closed = false;
  {
    MutexLock lock(&mu_);
    closed = closed_;
    if (closed) {
      if (error) {
        CloseSocketLocked();
        on_message_ = nullptr;
      } else if (socket_.is_open()) {
        StartReadLocked();
      }
      return;
    }
    if (!error && bytes > 0) last_receive_ = Clock::now();
  }
  if (error) {
    absl::Status status;
    if (error == asio::error::eof) {
      const absl::Status truncated = decoder_.Finish();
      status = truncated.ok()
                   ? absl::UnavailableError(absl::StrCat("peer ", remote_address_,
                                                         " closed the connection without Goodbye"))
                   : absl::UnavailableError(
                         absl::StrCat("peer ", remote_address_,
                                      " closed the connection mid-frame: ", truncated.message()));
    } else {
      status = absl::UnavailableError(
          absl::StrCat("reading from peer ", remote_address_, " failed: ", error.message()));
    }
    CloseWith(status, /*send_goodbye=*/false);
    ContinueReading();
    return;
  }
  const absl::Status fed = decoder_.Feed(read_buffer_.data(), bytes);
  // Envelopes before a bad frame were valid; deliver them before giving up on the stream.
  DeliverDecoded();
  if (!fed.ok()) {
    CloseWith(absl::Status(fed.code(), absl::StrCat("protocol error from peer ", remote_address_,
                                                    ": ", fed.message())),
              /*send_goodbye=*/true);
  }
  ContinueReading();
}

void TcpConnection::DeliverDecoded() {
  pb::Envelope envelope;
  while (decoder_.has_pending()) {
    {
      MutexLock lock(&mu_);
      if (closed_) return;
    }
    decoder_.Next(&envelope);
    switch (envelope.body_case()) {
      case pb::Envelope::kHeartbeat:
        break;
      case pb::Envelope::kGoodbye: {
        const pb::Goodbye& goodbye = envelope.goodbye();
        const std::string reason =
            goodbye.reason().empty() ? "(no reason given)" : goodbye.reason();
        CloseWith(
            StatusFromWire(goodbye.code(), absl::StrCat(reason, " (peer ", remote_address_, ")"),
                           "peer closed: "),
            /*send_goodbye=*/false);
        return;
      }
      case pb::Envelope::kReject:
        // The listener refused this dialer's AuthProof after Dial had returned.
        CloseWith(StatusFromWire(envelope.reject().code(), envelope.reject().reason(),
                                 absl::StrCat("rejected by peer ", remote_address_, ": "),
                                 absl::StatusCode::kPermissionDenied),
                  /*send_goodbye=*/false);
        return;
      case pb::Envelope::kHello:
      case pb::Envelope::kHelloAck:
      case pb::Envelope::kAuthProof:
      case pb::Envelope::kWelcome:
        CloseWith(absl::InvalidArgumentError(
                      absl::StrCat("protocol error from peer ", remote_address_, ": unexpected ",
                                   MessageName(envelope), " after the handshake")),
                  /*send_goodbye=*/true);
        return;
      default:
        if (on_message_) on_message_(envelope);
        break;
    }
  }
}

void TcpConnection::StartWriteLocked() {
  if (writing_ || send_queue_.empty() || !socket_.is_open()) return;
  writing_ = true;
  in_flight_.assign(std::make_move_iterator(send_queue_.begin()),
                    std::make_move_iterator(send_queue_.end()));
  send_queue_.clear();
  std::vector<asio::const_buffer> buffers;
  buffers.reserve(in_flight_.size());
  for (const std::string& frame : in_flight_) buffers.push_back(asio::buffer(frame));
  asio::async_write(socket_, buffers, [self = Self()](const error_code& error, size_t /*bytes*/) {
    self->OnWrite(error);
  });
}

void TcpConnection::OnWrite(const error_code& error) {
  absl::Status failure;
  {
    MutexLock lock(&mu_);
    writing_ = false;
    for (const std::string& frame : in_flight_) queued_bytes_ -= frame.size();
    in_flight_.clear();
    if (error) {
      if (closed_) {
        CloseSocketLocked();
        return;
      }
      failure = absl::UnavailableError(
          absl::StrCat("writing to peer ", remote_address_, " failed: ", error.message()));
    } else {
      StartWriteLocked();
      if (!writing_ && closed_ && socket_.is_open()) {
        // Goodbye flushed: send FIN and let the read chain wait for the peer's EOF.
        error_code ignored;
        socket_.shutdown(asio::ip::tcp::socket::shutdown_send, ignored);
      }
    }
  }
  if (!failure.ok()) CloseWith(failure, /*send_goodbye=*/false);
}

void TcpConnection::ArmHeartbeatLocked() {
  heartbeat_timer_.expires_after(heartbeat_interval_);
  heartbeat_timer_.async_wait(
      [self = Self()](const error_code& error) { self->OnHeartbeat(error); });
}

void TcpConnection::OnHeartbeat(const error_code& error) {
  if (error) return;
  MutexLock lock(&mu_);
  if (closed_) return;
  // Any bytes refresh the peer's lease, so a heartbeat is only needed when nothing else is
  // being sent; this also keeps heartbeats from piling up behind a peer that stopped reading.
  if (!writing_ && send_queue_.empty()) {
    pb::Envelope heartbeat;
    heartbeat.mutable_heartbeat()->set_seq(++heartbeat_seq_);
    absl::StatusOr<std::string> frame = EncodeFrame(heartbeat, max_frame_bytes_);
    if (frame.ok()) {
      queued_bytes_ += frame->size();
      send_queue_.push_back(*std::move(frame));
      StartWriteLocked();
    }
  }
  ArmHeartbeatLocked();
}

void TcpConnection::ArmLeaseLocked(Clock::time_point expiry) {
  lease_timer_.expires_at(expiry);
  lease_timer_.async_wait([self = Self()](const error_code& error) { self->OnLease(error); });
}

void TcpConnection::OnLease(const error_code& error) {
  if (error) return;
  absl::Status dead;
  {
    MutexLock lock(&mu_);
    if (closed_) return;
    const Clock::time_point expiry = last_receive_ + lease_;
    if (Clock::now() < expiry) {
      ArmLeaseLocked(expiry);
      return;
    }
    dead = absl::UnavailableError(absl::StrCat("peer ", remote_address_, " silent for ",
                                               absl::FormatDuration(lease_duration_),
                                               "; declared dead"));
  }
  KVW_LOG(kWarning, "control") << "peer lease expired" << Kv("peer", remote_address_);
  CloseWith(dead, /*send_goodbye=*/true);
}

void TcpConnection::OnLinger(const error_code& error) {
  if (error) return;
  MutexLock lock(&mu_);
  CloseSocketLocked();
}

}  // namespace kvwire::control
