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
#include "absl/strings/str_cat.h"

#include "src/control/address.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "src/control/listener_state.h"
#include "src/util/log.h"
#include "src/util/mutex.h"

namespace kvwire::control::listener_internal {
namespace {

// Delay before accepting again after accept() failed (e.g. out of file descriptors), so the
// loop does not spin.
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(100);

// How long a dialer refused at accept may take to read the Reject and close its side.
constexpr auto kRefusalLinger = std::chrono::seconds(1);

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

// Set while this thread runs a listener callback, so that Stop from inside one does not wait
// for itself.
thread_local const ListenerState* t_in_callback = nullptr;

}  // namespace

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

}  // namespace kvwire::control::listener_internal

namespace kvwire::control {
namespace {

namespace asio = boost::asio;
using listener_internal::ListenerState;

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