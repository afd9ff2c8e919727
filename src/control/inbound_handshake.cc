// One inbound control handshake (listener_state.h's InboundHandshake): Hello -> HelloAck
// [-> AuthProof -> Welcome], as described in handshake.h, under one absolute deadline.
#include <algorithm>
#include <utility>

#include <boost/asio/buffer.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/write.hpp>

#include "absl/strings/str_cat.h"

#include "src/control/address.h"
#include "src/control/connection.h"
#include "src/control/handshake.h"
#include "src/control/listener_state.h"
#include "src/util/log.h"

namespace kvwire::control::listener_internal {

void InboundHandshake::Start() {
  MutexLock lock(&mu_);
  error_code ignored;
  socket_.set_option(tcp::no_delay(true), ignored);
  // One absolute deadline for every stage (Hello, AuthProof, our writes, a Reject): a dialer
  // that trickles bytes gains nothing, as nothing it sends re-arms it.
  deadline_timer_.expires_after(absl::ToChronoNanoseconds(config_.timeout));
  deadline_timer_.async_wait(
      [self = shared_from_this()](const error_code& error) { self->OnDeadline(error); });
  socket_.async_read_some(asio::buffer(read_buffer_),
                          [self = shared_from_this()](const error_code& error, size_t bytes) {
                            self->OnRead(error, bytes);
                          });
}

void InboundHandshake::Abort() {
  std::string token;
  {
    MutexLock lock(&mu_);
    finished_ = true;
    error_code ignored;
    socket_.close(ignored);
    deadline_timer_.cancel();
    token = std::exchange(local_token_, std::string());
    slot_.reset();
  }
  RevokeToken(std::move(token));
}

absl::StatusOr<std::string> InboundHandshake::IssueToken() {
  if (!config_.issue_token) return std::string();
  absl::StatusOr<std::string> token = config_.issue_token();
  if (!token.ok()) {
    return absl::Status(token.status().code(),
                        absl::StrCat("cannot issue a session token for ", remote_address_, ": ",
                                     token.status().message()));
  }
  {
    MutexLock lock(&mu_);
    if (!finished_) {
      local_token_ = *token;
      return token;
    }
  }
  // Stopped or timed out meanwhile: nobody else will revoke it.
  RevokeToken(*std::move(token));
  return absl::CancelledError("handshake ended while issuing its token");
}

void InboundHandshake::RevokeToken(std::string token) {
  if (!token.empty() && config_.revoke_token) config_.revoke_token(token);
}

void InboundHandshake::ReadMore() {
  MutexLock lock(&mu_);
  if (finished_ || !socket_.is_open()) return;
  socket_.async_read_some(asio::buffer(read_buffer_),
                          [self = shared_from_this()](const error_code& error, size_t bytes) {
                            self->OnRead(error, bytes);
                          });
}

void InboundHandshake::OnRead(const error_code& error, size_t bytes) {
  if (error == asio::error::operation_aborted) return;  // deadline, Abort or Fail closed it
  if (error) {
    Fail(absl::UnavailableError(
             absl::StrCat("dialer ", remote_address_, " ",
                          error == asio::error::eof ? std::string("closed the connection")
                                                    : "read failed: " + error.message(),
                          " during the handshake (waiting for ", Awaiting(), ")")),
         /*send_reject=*/false);
    return;
  }
  decode_error_ = decoder_.Feed(read_buffer_.data(), bytes);
  Pump();
}

void InboundHandshake::Pump() {
  pb::Envelope envelope;
  if (!decoder_.Next(&envelope)) {
    if (!decode_error_.ok()) {
      Fail(absl::Status(decode_error_.code(),
                        absl::StrCat("protocol error from dialer ", remote_address_,
                                     " during the handshake: ", decode_error_.message())),
           /*send_reject=*/true);
    } else {
      ReadMore();
    }
    return;
  }
  if (envelope.has_reject()) {
    Fail(StatusFromWire(envelope.reject().code(), envelope.reject().reason(),
                        absl::StrCat("rejected by dialer ", remote_address_, ": "),
                        absl::StatusCode::kPermissionDenied),
         /*send_reject=*/false);
    return;
  }
  if (phase_ == Phase::kAwaitHello && envelope.has_hello()) {
    HandleHello(envelope.hello());
  } else if (phase_ == Phase::kAwaitProof && envelope.has_auth_proof()) {
    HandleProof(envelope.auth_proof());
  } else {
    Fail(
        absl::InvalidArgumentError(absl::StrCat("dialer ", remote_address_, " sent ",
                                                MessageName(envelope), " instead of ", Awaiting())),
        /*send_reject=*/true);
  }
}

void InboundHandshake::HandleHello(const pb::Hello& hello) {
  dialer_hello_ = hello;
  absl::Status checked = CheckPeerHello(hello, remote_address_, config_, kListenerRoles);
  if (!checked.ok()) {
    Fail(checked, /*send_reject=*/true);
    return;
  }
  absl::StatusOr<pb::Hello> response = listener_->Respond(hello);
  if (!response.ok()) {
    Fail(response.status(), /*send_reject=*/true);
    return;
  }
  absl::StatusOr<pb::Hello> prepared = PrepareHello(*std::move(response), config_);
  if (!prepared.ok()) {
    Fail(prepared.status(), /*send_reject=*/true);
    return;
  }
  listener_hello_ = *std::move(prepared);
  pb::Envelope ack;
  const bool with_secret = !config_.shared_secret.empty();
  if (with_secret) {
    // The dialer's token comes with its proof; one in its Hello is not trusted.
    dialer_hello_.clear_session_token();
    ack.mutable_hello_ack()->set_auth_proof(
        ListenerProof(config_.shared_secret, hello.auth_nonce(), listener_hello_.auth_nonce()));
    phase_ = Phase::kAwaitProof;
  } else {
    // No secret: nothing to prove, so the Hello checks were the whole handshake.
    absl::StatusOr<std::string> token = IssueToken();
    if (!token.ok()) {
      Fail(token.status(), /*send_reject=*/true);
      return;
    }
    listener_hello_.set_session_token(*std::move(token));
  }
  *ack.mutable_hello_ack()->mutable_hello() = listener_hello_;
  SendFrame(std::move(ack), /*then_succeed=*/!with_secret);
}

void InboundHandshake::HandleProof(const pb::AuthProof& proof) {
  const std::string expected =
      DialerProof(config_.shared_secret, listener_hello_.auth_nonce(), dialer_hello_.auth_nonce());
  if (!ProofMatches(expected, proof.proof())) {
    Fail(absl::PermissionDeniedError(absl::StrCat("shared secret mismatch: dialer ",
                                                  DescribePeer(dialer_hello_, remote_address_),
                                                  " failed the HMAC challenge")),
         /*send_reject=*/true);
    return;
  }
  // Authenticated: only now does the dialer's token count, and only now is one issued to it.
  dialer_hello_.set_session_token(proof.session_token());
  absl::StatusOr<std::string> token = IssueToken();
  if (!token.ok()) {
    Fail(token.status(), /*send_reject=*/true);
    return;
  }
  pb::Envelope welcome;
  welcome.mutable_welcome()->set_session_token(*std::move(token));
  SendFrame(std::move(welcome), /*then_succeed=*/true);
}

void InboundHandshake::SendFrame(pb::Envelope envelope, bool then_succeed) {
  const char* const name = MessageName(envelope);
  absl::StatusOr<std::string> frame = EncodeFrame(envelope, config_.max_frame_bytes);
  if (!frame.ok()) {
    Fail(absl::Status(frame.status().code(),
                      absl::StrCat("cannot send ", name, ": ", frame.status().message())),
         /*send_reject=*/true);
    return;
  }
  MutexLock lock(&mu_);
  if (finished_) return;
  outgoing_ = *std::move(frame);
  asio::async_write(
      socket_, asio::buffer(outgoing_),
      [self = shared_from_this(), then_succeed, name](const error_code& error, size_t) {
        if (error) {
          self->Fail(absl::UnavailableError(absl::StrCat("sending ", name, " to dialer ",
                                                         self->remote_address_,
                                                         " failed: ", error.message())),
                     /*send_reject=*/false);
        } else if (then_succeed) {
          self->Succeed();
        } else {
          self->Pump();  // AuthProof may already be decoded
        }
      });
}

void InboundHandshake::OnDeadline(const error_code& error) {
  if (error) return;
  bool finished = false;
  {
    MutexLock lock(&mu_);
    finished = finished_;
    if (finished) {
      // A Reject that the dialer does not read must not hold the socket open forever.
      error_code ignored;
      socket_.close(ignored);
      slot_.reset();
    }
  }
  if (!finished) {
    Fail(absl::DeadlineExceededError(absl::StrCat(
             "dialer ", remote_address_, " did not complete the handshake within ",
             absl::FormatDuration(config_.timeout), " (waiting for ", Awaiting(), ")")),
         /*send_reject=*/false);
  }
}

void InboundHandshake::Fail(const absl::Status& error, bool send_reject) {
  std::string token;
  {
    MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    token = std::exchange(local_token_, std::string());
    absl::StatusOr<std::string> frame =
        send_reject ? EncodeFrame(MakeReject(error), config_.max_frame_bytes)
                    : absl::StatusOr<std::string>(absl::CancelledError());
    error_code ignored;
    if (frame.ok() && socket_.is_open()) {
      // The deadline timer stays armed to bound this write.
      outgoing_ = *std::move(frame);
      asio::async_write(socket_, asio::buffer(outgoing_),
                        [self = shared_from_this()](const error_code&, size_t) {
                          MutexLock lock(&self->mu_);
                          error_code ignored;
                          self->socket_.shutdown(tcp::socket::shutdown_both, ignored);
                          self->socket_.close(ignored);
                          self->deadline_timer_.cancel();
                          self->slot_.reset();
                        });
    } else {
      socket_.close(ignored);
      deadline_timer_.cancel();
      slot_.reset();
    }
  }
  RevokeToken(std::move(token));
  KVW_LOG(kWarning, "control") << "inbound handshake failed" << Kv("dialer", remote_address_)
                               << Kv("error", error.ToString());
  listener_->Failed(this, remote_address_, error);
}

void InboundHandshake::Succeed() {
  std::shared_ptr<TcpConnection> connection;
  std::string token;
  {
    MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    deadline_timer_.cancel();
    connection =
        TcpConnection::Create(std::move(socket_), std::move(decoder_), config_.max_frame_bytes,
                              config_.max_send_queue_bytes, std::move(slot_));
    token = std::exchange(local_token_, std::string());
  }
  KVW_LOG(kInfo, "control") << "inbound handshake done" << Kv("dialer", remote_address_)
                            << Kv("name", dialer_hello_.engine_name());
  listener_->Succeeded(this, Accepted{std::move(connection), dialer_hello_, std::move(token)});
}

}  // namespace kvwire::control::listener_internal
