#include "src/control/listener.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <utility>
#include <vector>

#include <boost/asio/buffer.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

#include "src/control/address.h"
#include "src/control/connection.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "src/util/admission.h"
#include "src/util/log.h"
#include "src/util/mutex.h"

namespace kvwire::control {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

// Delay before accepting again after accept() failed (e.g. out of file descriptors), so the
// loop does not spin.
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(100);

// How long a dialer refused at accept may take to read the Reject and close its side.
constexpr auto kRefusalLinger = std::chrono::seconds(1);

class InboundHandshake;

// Tells a dialer refused at accept why (Reject), then closes: FIN first and a short, bounded
// wait for the dialer's EOF, so that closing with its Hello unread does not reset the
// connection and lose the Reject.
class Refusal : public std::enable_shared_from_this<Refusal> {
 public:
  Refusal(tcp::socket socket, std::string frame, std::shared_ptr<std::atomic<int>> count)
      : socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        frame_(std::move(frame)),
        count_(std::move(count)) {}
  ~Refusal() { count_->fetch_sub(1); }

  void Start() {
    MutexLock lock(&mu_);
    timer_.expires_after(kRefusalLinger);
    timer_.async_wait([self = shared_from_this()](const error_code& error) {
      if (error) return;
      MutexLock lock(&self->mu_);
      error_code ignored;
      self->socket_.close(ignored);
    });
    asio::async_write(socket_, asio::buffer(frame_),
                      [self = shared_from_this()](const error_code& error, size_t) {
                        MutexLock lock(&self->mu_);
                        error_code ignored;
                        if (error) {
                          self->socket_.close(ignored);
                          self->timer_.cancel();
                          return;
                        }
                        self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
                        self->DrainLocked();
                      });
  }

 private:
  void DrainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!socket_.is_open()) return;
    socket_.async_read_some(asio::buffer(drain_),
                            [self = shared_from_this()](const error_code& error, size_t) {
                              MutexLock lock(&self->mu_);
                              if (!error) {
                                self->DrainLocked();
                                return;
                              }
                              error_code ignored;
                              self->socket_.close(ignored);
                              self->timer_.cancel();
                            });
  }

  Mutex mu_;
  tcp::socket socket_ ABSL_GUARDED_BY(mu_);
  asio::steady_timer timer_ ABSL_GUARDED_BY(mu_);
  const std::string frame_;
  std::array<char, 4096> drain_;
  const std::shared_ptr<std::atomic<int>> count_;
};

// Shared by the Server handle and every pending handshake, so handlers never outlive it.
class ListenerState : public std::enable_shared_from_this<ListenerState> {
 public:
  ListenerState(asio::io_context& io, HandshakeConfig config, HelloResponder responder,
                AcceptHandler on_accept)
      : config_(std::move(config)),
        responder_(std::move(responder)),
        on_accept_(std::move(on_accept)),
        acceptor_(io),
        retry_timer_(io),
        admission_(Admission::Limits{
            .max_pending = static_cast<size_t>(std::max(config_.max_pending_handshakes, 0)),
            .max_pending_per_source =
                static_cast<size_t>(std::max(config_.max_pending_handshakes_per_source, 1)),
            .max_open = static_cast<size_t>(std::max(config_.max_connections, 0))}) {}

  absl::StatusOr<uint16_t> Open(const std::string& host, uint16_t port);
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  const HandshakeConfig& config() const { return config_; }
  absl::StatusOr<pb::Hello> Respond(const pb::Hello& remote) const { return responder_(remote); }
  ServerStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

  // Called once per handshake, outside the handshake's lock.
  void Succeeded(const InboundHandshake* handshake, Accepted accepted) ABSL_LOCKS_EXCLUDED(mu_);
  void Failed(const InboundHandshake* handshake, const std::string& remote_address,
              const absl::Status& error) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void AcceptLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnAccept(const error_code& error, tcp::socket socket) ABSL_LOCKS_EXCLUDED(mu_);
  // Refuses a dialer over a limit: Reject{ResourceExhausted} and close.
  void RefuseLocked(tcp::socket socket, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts one open inbound socket until the returned slot is released.
  std::shared_ptr<const void> TakeConnectionSlot();
  // Brackets a user callback; false if stopped (the callback must not run).
  bool BeginCallback(const InboundHandshake* handshake) ABSL_LOCKS_EXCLUDED(mu_);
  void EndCallback() ABSL_LOCKS_EXCLUDED(mu_);

  const HandshakeConfig config_;
  const HelloResponder responder_;
  const AcceptHandler on_accept_;

  mutable Mutex mu_;
  CondVar callbacks_done_;
  tcp::acceptor acceptor_ ABSL_GUARDED_BY(mu_);
  asio::steady_timer retry_timer_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<const InboundHandshake*, std::shared_ptr<InboundHandshake>> pending_
      ABSL_GUARDED_BY(mu_);
  // The source address of each pending handshake, counted by `admission_` (its limits:
  // max_pending_handshakes, max_pending_handshakes_per_source, max_connections).
  absl::flat_hash_map<const InboundHandshake*, std::string> pending_source_ ABSL_GUARDED_BY(mu_);
  Admission admission_ ABSL_GUARDED_BY(mu_);
  int callbacks_running_ ABSL_GUARDED_BY(mu_) = 0;
  // Inbound sockets open (handshaking or handed over), and refusals still lingering.
  const std::shared_ptr<std::atomic<uint64_t>> open_connections_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  const std::shared_ptr<std::atomic<int>> refusing_ = std::make_shared<std::atomic<int>>(0);
  std::atomic<uint64_t> handshakes_failed_{0};
  std::atomic<uint64_t> refused_over_limit_{0};
};

// Set while this thread runs a listener callback, so that Stop from inside one does not wait
// for itself.
thread_local const ListenerState* t_in_callback = nullptr;

// One inbound handshake: Hello -> HelloAck [-> AuthProof], as described in handshake.h.
class InboundHandshake : public std::enable_shared_from_this<InboundHandshake> {
 public:
  InboundHandshake(std::shared_ptr<ListenerState> listener, tcp::socket socket,
                   std::shared_ptr<const void> slot)
      : listener_(std::move(listener)),
        config_(listener_->config()),
        remote_address_(RemoteAddress(socket)),
        decoder_(std::min(config_.max_frame_bytes, kMaxHandshakeFrameBytes)),
        socket_(std::move(socket)),
        deadline_timer_(socket_.get_executor()),
        slot_(std::move(slot)) {}

  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  // Listener stopped: drop the connection without callbacks.
  void Abort() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class Phase { kAwaitHello, kAwaitProof };

  static std::string RemoteAddress(const tcp::socket& socket) {
    error_code error;
    const tcp::endpoint endpoint = socket.remote_endpoint(error);
    return error ? std::string("<unknown dialer>") : FormatEndpoint(endpoint);
  }
  const char* Awaiting() const { return phase_ == Phase::kAwaitHello ? "Hello" : "AuthProof"; }

  // Read chain: one read or write in flight at a time.
  void ReadMore() ABSL_LOCKS_EXCLUDED(mu_);
  void OnRead(const error_code& error, size_t bytes);
  void Pump();
  void HandleHello(const pb::Hello& hello);
  void HandleProof(const pb::AuthProof& proof);
  // Issues this side's session token (see HandshakeConfig::issue_token); "" without an issuer.
  absl::StatusOr<std::string> IssueToken() ABSL_LOCKS_EXCLUDED(mu_);
  void RevokeToken(std::string token);
  void SendFrame(pb::Envelope envelope, bool then_succeed);
  void OnDeadline(const error_code& error);

  void Fail(const absl::Status& error, bool send_reject) ABSL_LOCKS_EXCLUDED(mu_);
  void Succeed() ABSL_LOCKS_EXCLUDED(mu_);

  const std::shared_ptr<ListenerState> listener_;
  const HandshakeConfig& config_;
  const std::string remote_address_;

  // Read chain state.
  FrameDecoder decoder_;
  absl::Status decode_error_;
  Phase phase_ = Phase::kAwaitHello;
  pb::Hello dialer_hello_;
  pb::Hello listener_hello_;
  std::array<char, 16 << 10> read_buffer_;

  Mutex mu_;
  tcp::socket socket_ ABSL_GUARDED_BY(mu_);
  asio::steady_timer deadline_timer_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::string outgoing_ ABSL_GUARDED_BY(mu_);     // the frame being written
  std::string local_token_ ABSL_GUARDED_BY(mu_);  // issued to the dialer, live until revoked
  std::shared_ptr<const void> slot_ ABSL_GUARDED_BY(mu_);  // this socket in the connection count
};

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

absl::StatusOr<uint16_t> ListenerState::Open(const std::string& host, uint16_t port) {
  const std::string where = FormatHostPort(host.empty() ? "0.0.0.0" : host, port);
  asio::io_context resolver_io;
  tcp::resolver resolver(resolver_io);
  error_code error;
  const tcp::resolver::results_type endpoints =
      resolver.resolve(host.empty() ? "0.0.0.0" : host, std::to_string(port),
                       tcp::resolver::passive | tcp::resolver::numeric_service, error);
  if (error || endpoints.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot listen on ", where,
                     ": cannot resolve the host: ", error ? error.message() : "no addresses"));
  }
  // "localhost" resolves to ::1 and 127.0.0.1; peers are far more likely to dial the latter.
  tcp::endpoint endpoint = endpoints.begin()->endpoint();
  for (const auto& entry : endpoints) {
    if (entry.endpoint().address().is_v4()) {
      endpoint = entry.endpoint();
      break;
    }
  }
  MutexLock lock(&mu_);
  acceptor_.open(endpoint.protocol(), error);
  if (!error) acceptor_.set_option(tcp::acceptor::reuse_address(true), error);
  if (!error) acceptor_.bind(endpoint, error);
  if (!error) acceptor_.listen(asio::socket_base::max_listen_connections, error);
  if (error) {
    error_code ignored;
    acceptor_.close(ignored);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", where, " (",
                                               FormatEndpoint(endpoint), "): ", error.message()));
  }
  const uint16_t bound_port = acceptor_.local_endpoint(error).port();
  if (error) {
    return absl::InternalError(
        absl::StrCat("cannot read the bound port of ", where, ": ", error.message()));
  }
  AcceptLocked();
  return bound_port;
}

void ListenerState::AcceptLocked() {
  acceptor_.async_accept([self = shared_from_this()](const error_code& error, tcp::socket socket) {
    self->OnAccept(error, std::move(socket));
  });
}

void ListenerState::OnAccept(const error_code& error, tcp::socket socket) {
  std::shared_ptr<InboundHandshake> handshake;
  {
    MutexLock lock(&mu_);
    if (stopped_ || error == asio::error::operation_aborted) return;
    if (error) {
      KVW_LOG(kWarning, "control") << "accept failed; retrying" << Kv("error", error.message());
      retry_timer_.expires_after(kAcceptRetryDelay);
      retry_timer_.async_wait([self = shared_from_this()](const error_code& timer_error) {
        if (timer_error) return;
        MutexLock lock(&self->mu_);
        if (!self->stopped_) self->AcceptLocked();
      });
      return;
    }
    AcceptLocked();
    error_code endpoint_error;
    const tcp::endpoint remote = socket.remote_endpoint(endpoint_error);
    const std::string source = endpoint_error ? std::string() : remote.address().to_string();
    switch (admission_.Check(source, open_connections_->load())) {
      case Admission::Refusal::kNone:
        break;
      case Admission::Refusal::kPending:
        RefuseLocked(std::move(socket), absl::ResourceExhaustedError(absl::StrCat(
                                            "too many control handshakes in flight (limit ",
                                            config_.max_pending_handshakes, "); try again later")));
        return;
      case Admission::Refusal::kPendingFromSource:
        RefuseLocked(std::move(socket),
                     absl::ResourceExhaustedError(absl::StrCat(
                         "too many control handshakes in flight from ", source, " (limit ",
                         config_.max_pending_handshakes_per_source, "); try again later")));
        return;
      case Admission::Refusal::kOpen:
        RefuseLocked(std::move(socket), absl::ResourceExhaustedError(absl::StrCat(
                                            "too many control connections (limit ",
                                            config_.max_connections, "); try again later")));
        return;
    }
    handshake = std::make_shared<InboundHandshake>(shared_from_this(), std::move(socket),
                                                   TakeConnectionSlot());
    pending_.emplace(handshake.get(), handshake);
    pending_source_.emplace(handshake.get(), source);
    admission_.BeginPending(source);
  }
  handshake->Start();
}

std::shared_ptr<const void> ListenerState::TakeConnectionSlot() {
  open_connections_->fetch_add(1);
  return std::shared_ptr<const void>(
      open_connections_.get(), [count = open_connections_](const void*) { count->fetch_sub(1); });
}

void ListenerState::RefuseLocked(tcp::socket socket, const absl::Status& why) {
  refused_over_limit_.fetch_add(1);
  error_code ignored;
  const std::string remote = [&] {
    const tcp::endpoint endpoint = socket.remote_endpoint(ignored);
    return ignored ? std::string("<unknown dialer>") : FormatEndpoint(endpoint);
  }();
  KVW_LOG(kWarning, "control") << "dialer refused" << Kv("dialer", remote)
                               << Kv("reason", why.message());
  absl::StatusOr<std::string> frame = EncodeFrame(MakeReject(why), config_.max_frame_bytes);
  // Lingering refusals are bounded too: past that, the dialer only sees the connection close.
  if (!frame.ok() || refusing_->load() >= std::max(config_.max_pending_handshakes, 1)) {
    socket.close(ignored);
    return;
  }
  refusing_->fetch_add(1);
  std::make_shared<Refusal>(std::move(socket), *std::move(frame), refusing_)->Start();
}

ServerStats ListenerState::Stats() const {
  ServerStats stats;
  {
    MutexLock lock(&mu_);
    stats.handshakes_in_flight = pending_.size();
  }
  stats.connections = open_connections_->load();
  stats.handshakes_failed = handshakes_failed_.load();
  stats.refused_over_limit = refused_over_limit_.load();
  return stats;
}

bool ListenerState::BeginCallback(const InboundHandshake* handshake) {
  MutexLock lock(&mu_);
  pending_.erase(handshake);
  if (auto it = pending_source_.find(handshake); it != pending_source_.end()) {
    admission_.EndPending(it->second);
    pending_source_.erase(it);
  }
  if (stopped_) return false;
  ++callbacks_running_;
  return true;
}

void ListenerState::EndCallback() {
  MutexLock lock(&mu_);
  if (--callbacks_running_ == 0) callbacks_done_.SignalAll();
}

void ListenerState::Succeeded(const InboundHandshake* handshake, Accepted accepted) {
  if (!BeginCallback(handshake)) {
    accepted.connection->Close(absl::UnavailableError("listener stopped"));
    if (!accepted.local_token.empty() && config_.revoke_token) {
      config_.revoke_token(accepted.local_token);
    }
    return;
  }
  t_in_callback = this;
  on_accept_(std::move(accepted));
  t_in_callback = nullptr;
  EndCallback();
}

void ListenerState::Failed(const InboundHandshake* handshake, const std::string& remote_address,
                           const absl::Status& error) {
  handshakes_failed_.fetch_add(1);
  if (!BeginCallback(handshake)) return;
  if (config_.on_handshake_failure) {
    t_in_callback = this;
    config_.on_handshake_failure(remote_address, error);
    t_in_callback = nullptr;
  }
  EndCallback();
}

void ListenerState::Stop() {
  std::vector<std::shared_ptr<InboundHandshake>> pending;
  {
    MutexLock lock(&mu_);
    if (!stopped_) {
      stopped_ = true;
      error_code ignored;
      acceptor_.close(ignored);
      retry_timer_.cancel();
      for (auto& [key, handshake] : pending_) pending.push_back(std::move(handshake));
      pending_.clear();
      pending_source_.clear();
      admission_.Clear();
    }
    if (t_in_callback != this) {
      while (callbacks_running_ > 0) callbacks_done_.Wait(&mu_);
    }
  }
  for (const std::shared_ptr<InboundHandshake>& handshake : pending) handshake->Abort();
}

class TcpServer final : public Server {
 public:
  TcpServer(std::shared_ptr<ListenerState> state, uint16_t port)
      : state_(std::move(state)), port_(port) {}
  ~TcpServer() override { Stop(); }
  uint16_t port() const override { return port_; }
  void Stop() override { state_->Stop(); }
  ServerStats stats() const override { return state_->Stats(); }

 private:
  const std::shared_ptr<ListenerState> state_;
  const uint16_t port_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> StartListener(asio::io_context& io, const std::string& host,
                                                      uint16_t port, const HandshakeConfig& config,
                                                      HelloResponder responder,
                                                      AcceptHandler on_accept) {
  auto state =
      std::make_shared<ListenerState>(io, config, std::move(responder), std::move(on_accept));
  absl::StatusOr<uint16_t> bound = state->Open(host, port);
  if (!bound.ok()) return bound.status();
  KVW_LOG(kInfo, "control") << "listening" << Kv("host", host) << Kv("port", *bound);
  return std::make_unique<TcpServer>(std::move(state), *bound);
}

}  // namespace kvwire::control
