// The control listener's state and its inbound handshakes, shared by listener.cc (accepting,
// admission, callbacks, stopping) and inbound_handshake.cc (one handshake). Internal to them.
#ifndef KVWIRE_CONTROL_LISTENER_STATE_H_
#define KVWIRE_CONTROL_LISTENER_STATE_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

#include "src/control/address.h"
#include "src/control/control.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "src/util/admission.h"
#include "src/util/mutex.h"

namespace kvwire::control::listener_internal {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

class InboundHandshake;

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

}  // namespace kvwire::control::listener_internal

#endif  // KVWIRE_CONTROL_LISTENER_STATE_H_
