#include "src/control/dialer.h"

#include <array>
#include <unistd.h>
#include <utility>

#include <boost/asio/buffer.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/control/address.h"
#include "src/control/connection.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "src/util/log.h"

namespace kvwire::control {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

// The dialer's socket on a private io_context, with blocking helpers that give up at one
// deadline. Everything runs on the calling thread, so no locking is needed.
class HandshakeStream {
 public:
  HandshakeStream(std::string address, absl::Time deadline, absl::Duration timeout,
                  uint32_t max_frame_bytes, uint64_t max_send_queue_bytes)
      : address_(std::move(address)),
        deadline_(deadline),
        timeout_(timeout),
        max_send_queue_bytes_(max_send_queue_bytes),
        resolver_(io_),
        socket_(io_),
        max_frame_bytes_(max_frame_bytes),
        // Until the listener has proven itself, it cannot make this side buffer more than a
        // handshake frame; the connection gets the full limit once the handshake is done.
        decoder_(std::min(max_frame_bytes, kMaxHandshakeFrameBytes)) {}

  absl::Status Connect(const HostPort& target);
  absl::Status Write(const pb::Envelope& envelope);
  // The next envelope; `awaiting` names it in errors.
  absl::StatusOr<pb::Envelope> Read(absl::string_view awaiting);
  // Tells the listener why this side gives up; errors are ignored.
  void SendRejectBestEffort(const absl::Status& reason);
  // Moves the socket to `io` and wraps it, with whatever was read ahead.
  absl::StatusOr<std::shared_ptr<TcpConnection>> Release(asio::io_context& io);

 private:
  // Runs the private io_context until `*done` or the deadline. On timeout, cancels the
  // pending operation and runs its handler (which refers to the caller's locals) first.
  absl::Status RunUntil(const bool* done, absl::string_view what);

  const std::string address_;
  const absl::Time deadline_;
  const absl::Duration timeout_;
  const uint64_t max_send_queue_bytes_;
  asio::io_context io_;
  tcp::resolver resolver_;
  tcp::socket socket_;
  const uint32_t max_frame_bytes_;
  FrameDecoder decoder_;
  absl::Status decode_error_;
  std::array<char, 16 << 10> read_buffer_;
};

absl::Status HandshakeStream::RunUntil(const bool* done, absl::string_view what) {
  io_.restart();
  while (!*done) {
    const absl::Duration left = deadline_ - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    io_.run_one_for(absl::ToChronoNanoseconds(left));
  }
  if (*done) return absl::OkStatus();
  resolver_.cancel();
  error_code ignored;
  socket_.close(ignored);
  io_.restart();
  while (!*done && io_.run_one() > 0) {
  }
  return absl::DeadlineExceededError(absl::StrCat("dialing ", address_, " timed out after ",
                                                  absl::FormatDuration(timeout_), " (", what, ")"));
}

absl::Status HandshakeStream::Connect(const HostPort& target) {
  bool done = false;
  error_code error;
  tcp::resolver::results_type endpoints;
  resolver_.async_resolve(target.host, std::to_string(target.port), tcp::resolver::numeric_service,
                          [&](const error_code& e, tcp::resolver::results_type results) {
                            error = e;
                            endpoints = std::move(results);
                            done = true;
                          });
  if (absl::Status s = RunUntil(&done, "resolving the host"); !s.ok()) return s;
  if (error || endpoints.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot resolve \"", target.host, "\" to dial ",
                                               address_, ": ",
                                               error ? error.message() : "no addresses"));
  }
  done = false;
  asio::async_connect(socket_, endpoints, [&](const error_code& e, const tcp::endpoint&) {
    error = e;
    done = true;
  });
  if (absl::Status s = RunUntil(&done, "connecting"); !s.ok()) return s;
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to ", address_, ": ", error.message()));
  }
  error_code ignored;
  socket_.set_option(tcp::no_delay(true), ignored);
  return absl::OkStatus();
}

absl::Status HandshakeStream::Write(const pb::Envelope& envelope) {
  absl::StatusOr<std::string> frame = EncodeFrame(envelope, max_frame_bytes_);
  if (!frame.ok()) {
    return absl::Status(frame.status().code(),
                        absl::StrCat("cannot send ", MessageName(envelope), " to ", address_, ": ",
                                     frame.status().message()));
  }
  bool done = false;
  error_code error;
  asio::async_write(socket_, asio::buffer(*frame), [&](const error_code& e, size_t) {
    error = e;
    done = true;
  });
  if (absl::Status s = RunUntil(&done, absl::StrCat("sending ", MessageName(envelope))); !s.ok()) {
    return s;
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat("sending ", MessageName(envelope), " to ", address_,
                                               " failed: ", error.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<pb::Envelope> HandshakeStream::Read(absl::string_view awaiting) {
  pb::Envelope envelope;
  while (!decoder_.Next(&envelope)) {
    if (!decode_error_.ok()) {
      return absl::Status(decode_error_.code(),
                          absl::StrCat("protocol error from peer ", address_,
                                       " during the handshake: ", decode_error_.message()));
    }
    bool done = false;
    error_code error;
    size_t bytes = 0;
    socket_.async_read_some(asio::buffer(read_buffer_), [&](const error_code& e, size_t n) {
      error = e;
      bytes = n;
      done = true;
    });
    if (absl::Status s = RunUntil(&done, absl::StrCat("waiting for ", awaiting)); !s.ok()) {
      return s;
    }
    if (error == asio::error::eof) {
      return absl::UnavailableError(absl::StrCat("peer ", address_,
                                                 " closed the connection during the handshake "
                                                 "(waiting for ",
                                                 awaiting, ")"));
    }
    if (error) {
      return absl::UnavailableError(absl::StrCat(
          "reading from ", address_, " failed during the handshake: ", error.message()));
    }
    decode_error_ = decoder_.Feed(read_buffer_.data(), bytes);
  }
  return envelope;
}

void HandshakeStream::SendRejectBestEffort(const absl::Status& reason) {
  if (absl::Now() < deadline_ && socket_.is_open()) (void)Write(MakeReject(reason));
}

absl::StatusOr<std::shared_ptr<TcpConnection>> HandshakeStream::Release(asio::io_context& io) {
  error_code error;
  const tcp::endpoint local = socket_.local_endpoint(error);
  tcp::socket::native_handle_type fd = -1;
  if (!error) fd = socket_.release(error);
  if (error) {
    return absl::InternalError(
        absl::StrCat("cannot hand the socket to ", address_, " over: ", error.message()));
  }
  tcp::socket socket(io);
  socket.assign(local.protocol(), fd, error);
  if (error) {
    ::close(fd);
    return absl::InternalError(
        absl::StrCat("cannot hand the socket to ", address_, " over: ", error.message()));
  }
  return TcpConnection::Create(std::move(socket), std::move(decoder_), max_frame_bytes_,
                               max_send_queue_bytes_);
}

}  // namespace

absl::StatusOr<Accepted> DialBlocking(asio::io_context& io, const std::string& address,
                                      const pb::Hello& local_hello, const HandshakeConfig& config) {
  const absl::Time deadline = absl::Now() + config.timeout;
  absl::StatusOr<HostPort> target = ParseHostPort(address);
  if (!target.ok()) return target.status();
  absl::StatusOr<pb::Hello> hello = PrepareHello(local_hello, config);
  if (!hello.ok()) return hello.status();
  const bool with_secret = !config.shared_secret.empty();

  // The token this side issues to the listener; revoked unless the handshake succeeds.
  std::string local_token;
  absl::Cleanup revoke = [&] {
    if (!local_token.empty() && config.revoke_token) config.revoke_token(local_token);
  };
  auto issue = [&]() -> absl::Status {
    if (!config.issue_token) return absl::OkStatus();
    absl::StatusOr<std::string> token = config.issue_token();
    if (!token.ok()) {
      return absl::Status(token.status().code(),
                          absl::StrCat("cannot issue a session token for ", address, ": ",
                                       token.status().message()));
    }
    local_token = *std::move(token);
    return absl::OkStatus();
  };

  HandshakeStream stream(address, deadline, config.timeout, config.max_frame_bytes,
                         config.max_send_queue_bytes);
  if (absl::Status s = stream.Connect(*target); !s.ok()) return s;

  if (!with_secret) {
    // No secret, nothing to prove: the token must be live before the listener can use it.
    if (absl::Status s = issue(); !s.ok()) return s;
    hello->set_session_token(local_token);
  }
  pb::Envelope hello_envelope;
  *hello_envelope.mutable_hello() = *hello;
  if (absl::Status s = stream.Write(hello_envelope); !s.ok()) return s;

  absl::StatusOr<pb::Envelope> answer = stream.Read("HelloAck");
  if (!answer.ok()) return answer.status();
  if (answer->has_reject()) {
    return StatusFromWire(answer->reject().code(), answer->reject().reason(),
                          absl::StrCat("rejected by peer ", address, ": "),
                          absl::StatusCode::kPermissionDenied);
  }
  if (!answer->has_hello_ack()) {
    const absl::Status error = absl::InvalidArgumentError(absl::StrCat(
        "peer ", address, " answered Hello with ", MessageName(*answer), " instead of HelloAck"));
    stream.SendRejectBestEffort(error);
    return error;
  }
  pb::HelloAck& ack = *answer->mutable_hello_ack();
  const std::string peer = DescribePeer(ack.hello(), address);
  if (absl::Status s = CheckPeerHello(ack.hello(), address, config, kDialerRoles); !s.ok()) {
    stream.SendRejectBestEffort(s);
    return s;
  }
  if (with_secret) {
    // A token in HelloAck would come from a listener that has not proven anything yet.
    ack.mutable_hello()->clear_session_token();
    const std::string expected =
        ListenerProof(config.shared_secret, hello->auth_nonce(), ack.hello().auth_nonce());
    if (!ProofMatches(expected, ack.auth_proof())) {
      stream.SendRejectBestEffort(absl::PermissionDeniedError(absl::StrCat(
          "shared secret mismatch: the listener's HMAC proof did not verify at dialer \"",
          hello->engine_name(), "\" (the two sides have different secrets)")));
      return absl::PermissionDeniedError(
          absl::StrCat("shared secret mismatch: peer ", peer, " failed the HMAC challenge"));
    }
    // The listener is authenticated: only now is a token issued to it. It is live before the
    // listener can hold it, so the listener may use it as soon as it has checked our proof.
    if (absl::Status s = issue(); !s.ok()) {
      stream.SendRejectBestEffort(s);
      return s;
    }
    pb::Envelope proof;
    proof.mutable_auth_proof()->set_proof(
        DialerProof(config.shared_secret, ack.hello().auth_nonce(), hello->auth_nonce()));
    proof.mutable_auth_proof()->set_session_token(local_token);
    if (absl::Status s = stream.Write(proof); !s.ok()) return s;

    absl::StatusOr<pb::Envelope> verdict = stream.Read("Welcome");
    if (!verdict.ok()) return verdict.status();
    if (verdict->has_reject()) {
      return StatusFromWire(verdict->reject().code(), verdict->reject().reason(),
                            absl::StrCat("rejected by peer ", address, ": "),
                            absl::StatusCode::kPermissionDenied);
    }
    if (!verdict->has_welcome()) {
      const absl::Status error =
          absl::InvalidArgumentError(absl::StrCat("peer ", peer, " answered AuthProof with ",
                                                  MessageName(*verdict), " instead of Welcome"));
      stream.SendRejectBestEffort(error);
      return error;
    }
    ack.mutable_hello()->set_session_token(verdict->welcome().session_token());
  }

  absl::StatusOr<std::shared_ptr<TcpConnection>> connection = stream.Release(io);
  if (!connection.ok()) return connection.status();
  KVW_LOG(kInfo, "control") << "dialed" << Kv("peer", address)
                            << Kv("name", ack.hello().engine_name());
  std::move(revoke).Cancel();
  return Accepted{*std::move(connection), ack.hello(), std::move(local_token)};
}

}  // namespace kvwire::control
