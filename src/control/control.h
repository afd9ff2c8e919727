// Control channel: Boost.Asio TCP, frames of a 4-byte big-endian length and one protobuf
// Envelope, a version/compatibility/secret handshake, and heartbeats with a lease.
#ifndef KVWIRE_CONTROL_CONTROL_H_
#define KVWIRE_CONTROL_CONTROL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include <boost/asio/io_context.hpp>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "proto/kvwire.pb.h"
#include "src/util/mutex.h"

namespace kvwire::control {

inline constexpr uint32_t kProtocolVersion = 1;

// Hash of the protocol definition (kvwire.proto's descriptor) mixed with `salt`; engines with
// different values refuse each other.
uint64_t CompatibilityHash(uint64_t salt);

// The auth nonces one engine issued recently (its dialer's and its listener's). A Hello that
// carries one of them is the engine's own Hello played back by a relay (A dials M, M replays
// A's Hello to A's listener and shuttles the proofs between A's two halves): refused, or a
// party without the secret would end up holding one of A's live tokens. Kept well past any
// handshake's deadline; bounded so that a flood of handshakes cannot grow it without end (the
// oldest go first). Thread-safe.
class OwnNonces {
 public:
  void Add(const std::string& nonce);
  bool Contains(const std::string& nonce);

 private:
  static constexpr size_t kMaxNonces = 1 << 16;
  static constexpr absl::Duration kRetention = absl::Minutes(5);

  Mutex mu_;
  absl::flat_hash_set<std::string> issued_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<absl::Time, std::string>> order_ ABSL_GUARDED_BY(mu_);
};

struct HandshakeConfig {
  uint64_t compat_hash = 0;
  std::string shared_secret;  // empty: none
  uint32_t max_frame_bytes = 16 << 20;
  absl::Duration timeout = absl::Seconds(10);

  // Optional: told about every inbound handshake that failed (after it was logged), with the
  // dialer's address. Runs on an io_context thread.
  std::function<void(const std::string& remote_address, const absl::Status& error)>
      on_handshake_failure;
  // Tests only: the protocol version this side claims and expects.
  uint32_t protocol_version_for_testing = kProtocolVersion;

  // Session tokens: what a peer presents on this side's data ports. The handshake owns the
  // Hello's session_token field (anything the caller put there is dropped) and asks for a
  // token only at the last moment: with a secret, once the peer's proof has verified (the
  // dialer sends its token in AuthProof, the listener in Welcome); without one, right before
  // the message that carries it (Hello, HelloAck). A token issued for a handshake that then
  // fails is handed to `revoke_token` before Dial returns / the listener forgets the dialer;
  // on success it is Accepted::local_token and the caller owns it. Unset: no token is sent.
  // Called on the dialing thread or an io_context thread.
  std::function<absl::StatusOr<std::string>()> issue_token;
  std::function<void(const std::string& token)> revoke_token;

  // Listener bounds. Inbound handshakes not yet finished (unauthenticated), and inbound
  // connections in total (handshaking plus established ones whose socket is still open). A
  // dialer beyond either is sent Reject{ResourceExhausted} naming the limit and closed.
  int max_pending_handshakes = 64;
  // Of those, from one source address (so that one host cannot keep the port refusing all).
  int max_pending_handshakes_per_source = 16;
  int max_connections = 1024;
  // Bytes a Connection may hold queued for a peer that is not reading (at least one frame of
  // max_frame_bytes). A Send that would exceed it closes the connection (ResourceExhausted).
  uint64_t max_send_queue_bytes = 64 << 20;
  // Shared by the dialer and the listener of one engine (copies of the config share it);
  // null: no reflection check.
  std::shared_ptr<OwnNonces> own_nonces;
};

// Largest frame accepted before the handshake has finished: a Hello with many transports
// fits easily, and an unauthenticated dialer cannot make the listener buffer more.
inline constexpr uint32_t kMaxHandshakeFrameBytes = 64 << 10;

// An established, authenticated control connection to one peer.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  using MessageHandler = std::function<void(const pb::Envelope&)>;
  // Called once when the connection ends: peer Goodbye, lease expiry, I/O or protocol error,
  // or local Close. The status says which.
  using CloseHandler = std::function<void(const absl::Status&)>;

  virtual ~Connection() = default;
  // Starts reading and heartbeating. Handlers run on the io_context's threads.
  virtual void Start(MessageHandler on_message, CloseHandler on_close,
                     absl::Duration heartbeat_interval, absl::Duration lease) = 0;
  // Queues one message; thread-safe. FailedPrecondition once closed.
  virtual absl::Status Send(const pb::Envelope& message) = 0;
  // Sends Goodbye{reason} (best effort), closes, and runs the close handler. Idempotent.
  virtual void Close(const absl::Status& reason) = 0;
  virtual std::string remote_address() const = 0;
};

struct Accepted {
  std::shared_ptr<Connection> connection;
  // The peer's Hello; session_token holds the peer's token wherever the protocol carried it.
  pb::Hello remote_hello;
  // The token this side issued to the peer (HandshakeConfig::issue_token), empty if none.
  std::string local_token;
};

// Builds the listener's Hello for a dialer's Hello, or refuses it (the status is sent to the
// dialer as a Reject and becomes its Connect error).
using HelloResponder = std::function<absl::StatusOr<pb::Hello>(const pb::Hello& remote)>;
// A handshake finished (the connection is not started yet: call Start).
using AcceptHandler = std::function<void(Accepted accepted)>;

// What a listener holds now, and what it refused so far.
struct ServerStats {
  uint64_t handshakes_in_flight = 0;  // accepted, not yet authenticated and handed over
  uint64_t connections = 0;           // inbound sockets open: handshaking + established
  uint64_t handshakes_failed = 0;     // bad Hello/proof, deadline, I/O error
  uint64_t refused_over_limit = 0;    // dialers refused by max_pending_handshakes/connections
};

class Server {
 public:
  virtual ~Server() = default;
  virtual uint16_t port() const = 0;
  virtual void Stop() = 0;
  virtual ServerStats stats() const = 0;
};

// Listens on host:port (port 0: any free port). Failed handshakes are logged with their
// reason and never reach `on_accept`.
absl::StatusOr<std::unique_ptr<Server>> Listen(boost::asio::io_context& io, const std::string& host,
                                               uint16_t port, const HandshakeConfig& config,
                                               HelloResponder responder, AcceptHandler on_accept);

// Dials "host:port", sends `local_hello`, and completes the handshake within config.timeout.
// Errors name what failed: unreachable, version/hash mismatch (both values), secret, Reject.
// Blocking: the handshake runs on a private io_context on the calling thread, so `io` needs
// no free thread; only the finished connection lives on `io` (see dialer.h).
absl::StatusOr<Accepted> Dial(boost::asio::io_context& io, const std::string& address,
                              const pb::Hello& local_hello, const HandshakeConfig& config);

}  // namespace kvwire::control

#endif  // KVWIRE_CONTROL_CONTROL_H_
