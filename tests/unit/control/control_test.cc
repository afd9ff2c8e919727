// Control channel over real loopback sockets: handshake outcomes, message flow, heartbeats
// and leases, Goodbye, timeouts and protocol errors. "Raw" peers speak the protocol by hand
// with plain POSIX calls (each with a timeout) to produce what a correct engine never sends.
#include "src/control/control.h"

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <optional>
#include <poll.h>
#include <thread>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/control/address.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "src/util/mutex.h"

namespace kvwire::control {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using ::testing::HasSubstr;

// Generous: the test machine is small and noisy, and sanitizers slow everything down.
constexpr absl::Duration kWait = absl::Seconds(20);

template <typename T>
class Queue {
 public:
  void Push(T value) {
    MutexLock lock(&mu_);
    items_.push_back(std::move(value));
    cv_.SignalAll();
  }
  std::optional<T> Pop(absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    MutexLock lock(&mu_);
    while (items_.empty()) {
      if (!cv_.WaitUntil(&mu_, deadline) && items_.empty()) return std::nullopt;
    }
    T value = std::move(items_.front());
    items_.pop_front();
    return value;
  }
  size_t size() {
    MutexLock lock(&mu_);
    return items_.size();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<T> items_ ABSL_GUARDED_BY(mu_);
};

// --- raw peer helpers -------------------------------------------------------------------

bool WriteAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

bool WriteEnvelope(int fd, const pb::Envelope& envelope) {
  absl::StatusOr<std::string> frame = EncodeFrame(envelope, 1 << 20);
  return frame.ok() && WriteAll(fd, *frame);
}

// Reads one envelope, failing on timeout, EOF or garbage. Bytes past it are kept in `decoder`.
absl::StatusOr<pb::Envelope> ReadEnvelope(int fd, FrameDecoder& decoder,
                                          absl::Duration timeout = kWait) {
  const absl::Time deadline = absl::Now() + timeout;
  pb::Envelope envelope;
  while (!decoder.Next(&envelope)) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("raw read timed out");
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
    char buffer[4096];
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0) return absl::UnavailableError("raw read: EOF");
    if (n < 0) return absl::UnavailableError("raw read: error");
    if (absl::Status s = decoder.Feed(buffer, static_cast<size_t>(n)); !s.ok()) return s;
  }
  return envelope;
}

// True once the peer closed its side (EOF or reset) within `timeout`; data is discarded.
bool WaitForEof(int fd, absl::Duration timeout = kWait) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buffer[4096];
    if (::recv(fd, buffer, sizeof(buffer), 0) <= 0) return true;
  }
  return false;
}

std::string Header(uint32_t length) {
  return std::string{static_cast<char>(length >> 24), static_cast<char>(length >> 16),
                     static_cast<char>(length >> 8), static_cast<char>(length)};
}

std::string LoopbackAddress(uint16_t port) { return absl::StrCat("127.0.0.1:", port); }

pb::Envelope MakeNotify(uint64_t id) {
  pb::Envelope envelope;
  envelope.mutable_notify()->set_transfer_id(id);
  return envelope;
}

pb::Hello NamedHello(const std::string& name) {
  pb::Hello hello;
  hello.set_engine_name(name);
  return hello;
}

struct CloseRecorder {
  Queue<absl::Status> statuses;
  Connection::CloseHandler Handler() {
    return [this](const absl::Status& status) { statuses.Push(status); };
  }
};

class ControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) threads_.emplace_back([this] { io_.run(); });
    config_.compat_hash = CompatibilityHash(0);
    config_.timeout = absl::Seconds(15);
    config_.on_handshake_failure = [this](const std::string&, const absl::Status& error) {
      failures_.Push(error);
    };
  }
  void TearDown() override {
    servers_.clear();
    work_.reset();
    io_.stop();
    for (std::thread& t : threads_) t.join();
  }

  // Starts a listener answering with Hello{engine_name = name}.
  uint16_t StartListener(const HandshakeConfig& config, const std::string& name = "listener") {
    auto responder = [this, name](const pb::Hello& remote) -> absl::StatusOr<pb::Hello> {
      responder_saw_.Push(remote);
      if (!refusal_.ok()) return refusal_;
      pb::Hello hello = NamedHello(name);
      hello.set_pid(4242);
      return hello;
    };
    absl::StatusOr<std::unique_ptr<Server>> server =
        Listen(io_, "127.0.0.1", 0, config, responder,
               [this](Accepted accepted) { accepted_.Push(std::move(accepted)); });
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return 0;
    const uint16_t port = (*server)->port();
    servers_.push_back(*std::move(server));
    return port;
  }
  static std::string Address(uint16_t port) { return LoopbackAddress(port); }

  // A connected pair: [0] dialer side, [1] listener side, neither started.
  std::pair<Accepted, Accepted> ConnectPair(const HandshakeConfig& config) {
    const uint16_t port = StartListener(config);
    absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("dialer"), config);
    EXPECT_TRUE(dialed.ok()) << dialed.status();
    std::optional<Accepted> accepted = accepted_.Pop();
    EXPECT_TRUE(accepted.has_value());
    if (!dialed.ok() || !accepted) return {};
    return {*std::move(dialed), *std::move(accepted)};
  }

  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_{
      io_.get_executor()};
  std::vector<std::thread> threads_;
  HandshakeConfig config_;
  std::vector<std::unique_ptr<Server>> servers_;
  absl::Status refusal_;
  Queue<pb::Hello> responder_saw_;
  Queue<Accepted> accepted_;
  Queue<absl::Status> failures_;
};

// --- handshake --------------------------------------------------------------------------

TEST_F(ControlTest, HandshakeWithoutSecretShowsBothHellos) {
  const uint16_t port = StartListener(config_);
  pb::Hello mine = NamedHello("dialer");
  mine.set_pid(42);
  mine.set_protocol_version(99);  // overwritten by Dial
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), mine, config_);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  EXPECT_EQ(dialed->remote_hello.engine_name(), "listener");
  EXPECT_EQ(dialed->remote_hello.pid(), 4242u);
  EXPECT_EQ(dialed->remote_hello.protocol_version(), kProtocolVersion);
  EXPECT_EQ(dialed->remote_hello.compat_hash(), config_.compat_hash);
  EXPECT_FALSE(dialed->remote_hello.has_secret());
  EXPECT_TRUE(dialed->remote_hello.auth_nonce().empty());
  EXPECT_EQ(dialed->connection->remote_address(), Address(port));

  std::optional<pb::Hello> seen = responder_saw_.Pop();
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(seen->engine_name(), "dialer");
  std::optional<Accepted> accepted = accepted_.Pop();
  ASSERT_TRUE(accepted.has_value());
  EXPECT_EQ(accepted->remote_hello.engine_name(), "dialer");
  EXPECT_EQ(accepted->remote_hello.pid(), 42u);
  EXPECT_EQ(accepted->remote_hello.protocol_version(), kProtocolVersion);
  EXPECT_THAT(accepted->connection->remote_address(), HasSubstr("127.0.0.1:"));
  EXPECT_EQ(failures_.size(), 0u);
}

TEST_F(ControlTest, HandshakeWithSecretThenMessagesFlow) {
  config_.shared_secret = "deployment-secret";
  auto pair = ConnectPair(config_);
  Accepted& dialer = pair.first;
  Accepted& listener = pair.second;
  ASSERT_TRUE(dialer.connection && listener.connection);
  EXPECT_TRUE(dialer.remote_hello.has_secret());
  EXPECT_TRUE(listener.remote_hello.has_secret());
  EXPECT_EQ(dialer.remote_hello.auth_nonce().size(), 32u);
  EXPECT_EQ(listener.remote_hello.auth_nonce().size(), 32u);
  EXPECT_NE(dialer.remote_hello.auth_nonce(), listener.remote_hello.auth_nonce());

  Queue<pb::Envelope> at_listener;
  CloseRecorder closes;
  dialer.connection->Start([](const pb::Envelope&) {}, closes.Handler(), absl::Milliseconds(100),
                           absl::Seconds(10));
  // Sent before the listener starts: must be buffered, not lost.
  ASSERT_TRUE(dialer.connection->Send(MakeNotify(5)).ok());
  listener.connection->Start([&](const pb::Envelope& e) { at_listener.Push(e); }, closes.Handler(),
                             absl::Milliseconds(100), absl::Seconds(10));
  std::optional<pb::Envelope> got = at_listener.Pop();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->notify().transfer_id(), 5u);
  dialer.connection->Close(absl::CancelledError("test done"));
  listener.connection->Close(absl::CancelledError("test done"));
}

TEST_F(ControlTest, ProtocolVersionMismatchNamesBothVersions) {
  const uint16_t port = StartListener(config_);
  HandshakeConfig newer = config_;
  newer.protocol_version_for_testing = 2;
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("newer"), newer);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(dialed.status().message(), HasSubstr("rejected by peer " + Address(port)));
  EXPECT_THAT(dialed.status().message(), HasSubstr("protocol version mismatch"));
  EXPECT_THAT(dialed.status().message(), HasSubstr("speaks 1"));
  EXPECT_THAT(dialed.status().message(), HasSubstr("\"newer\""));
  EXPECT_THAT(dialed.status().message(), HasSubstr("speaks 2"));

  std::optional<absl::Status> failure = failures_.Pop();
  ASSERT_TRUE(failure.has_value());
  EXPECT_THAT(failure->message(), HasSubstr("speaks 1"));
  EXPECT_THAT(failure->message(), HasSubstr("speaks 2"));
  EXPECT_EQ(accepted_.size(), 0u);
}

TEST_F(ControlTest, CompatibilityHashMismatchNamesBothHashes) {
  const uint64_t mine = CompatibilityHash(1);
  const uint64_t theirs = CompatibilityHash(2);
  ASSERT_NE(mine, theirs);
  config_.compat_hash = theirs;
  const uint16_t port = StartListener(config_);
  HandshakeConfig dialer_config = config_;
  dialer_config.compat_hash = mine;
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("d"), dialer_config);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(dialed.status().message(), HasSubstr("compatibility hash mismatch"));
  EXPECT_THAT(dialed.status().message(),
              HasSubstr(absl::StrCat("0x", absl::Hex(mine, absl::kZeroPad16))));
  EXPECT_THAT(dialed.status().message(),
              HasSubstr(absl::StrCat("0x", absl::Hex(theirs, absl::kZeroPad16))));
}

TEST(CompatibilityHashTest, DependsOnSaltAndIsStable) {
  EXPECT_EQ(CompatibilityHash(7), CompatibilityHash(7));
  EXPECT_NE(CompatibilityHash(7), CompatibilityHash(8));
  EXPECT_NE(CompatibilityHash(0), 0u);
}

TEST_F(ControlTest, DialerChecksTheAckVersionToo) {
  // A raw listener that answers any Hello with a HelloAck claiming version 2.
  tcp::acceptor acceptor(io_, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
  const uint16_t port = acceptor.local_endpoint().port();
  auto dial = std::async(std::launch::async,
                         [&] { return Dial(io_, Address(port), NamedHello("d"), config_); });
  boost::system::error_code error;
  tcp::socket raw = acceptor.accept(error);
  ASSERT_FALSE(error) << error.message();
  FrameDecoder decoder(1 << 20);
  ASSERT_TRUE(ReadEnvelope(raw.native_handle(), decoder).ok());
  pb::Envelope ack;
  *ack.mutable_hello_ack()->mutable_hello() = NamedHello("old-listener");
  ack.mutable_hello_ack()->mutable_hello()->set_protocol_version(2);
  ack.mutable_hello_ack()->mutable_hello()->set_compat_hash(config_.compat_hash);
  ASSERT_TRUE(WriteEnvelope(raw.native_handle(), ack));

  absl::StatusOr<Accepted> dialed = dial.get();
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(dialed.status().message(), HasSubstr("this engine speaks 1"));
  EXPECT_THAT(dialed.status().message(), HasSubstr("\"old-listener\""));
  EXPECT_THAT(dialed.status().message(), HasSubstr("speaks 2"));
  // The dialer tells the listener why.
  absl::StatusOr<pb::Envelope> reject = ReadEnvelope(raw.native_handle(), decoder);
  ASSERT_TRUE(reject.ok()) << reject.status();
  ASSERT_TRUE(reject->has_reject());
  EXPECT_THAT(reject->reject().reason(), HasSubstr("protocol version mismatch"));
}

TEST_F(ControlTest, WrongSecretRejectedOnBothSides) {
  config_.shared_secret = "listener-secret";
  const uint16_t port = StartListener(config_, "L");
  HandshakeConfig dialer_config = config_;
  dialer_config.shared_secret = "dialer-secret";
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("D"), dialer_config);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(dialed.status().message(), HasSubstr("shared secret mismatch: peer \"L\" (" +
                                                   Address(port) + ") failed the HMAC challenge"));

  std::optional<absl::Status> failure = failures_.Pop();
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(failure->message(), HasSubstr("shared secret mismatch"));
  EXPECT_THAT(failure->message(), HasSubstr("\"D\""));
  EXPECT_EQ(accepted_.size(), 0u);
}

TEST_F(ControlTest, ListenerRejectsBadAuthProof) {
  // A raw dialer that claims a secret but cannot compute the proof.
  config_.shared_secret = "s";
  const uint16_t port = StartListener(config_);
  tcp::socket raw(io_);
  boost::system::error_code error;
  raw.connect(tcp::endpoint(asio::ip::address_v4::loopback(), port), error);
  ASSERT_FALSE(error) << error.message();
  pb::Envelope hello;
  *hello.mutable_hello() = NamedHello("impostor");
  hello.mutable_hello()->set_protocol_version(kProtocolVersion);
  hello.mutable_hello()->set_compat_hash(config_.compat_hash);
  hello.mutable_hello()->set_has_secret(true);
  hello.mutable_hello()->set_auth_nonce(std::string(32, 'n'));
  ASSERT_TRUE(WriteEnvelope(raw.native_handle(), hello));
  FrameDecoder decoder(1 << 20);
  absl::StatusOr<pb::Envelope> ack = ReadEnvelope(raw.native_handle(), decoder);
  ASSERT_TRUE(ack.ok()) << ack.status();
  ASSERT_TRUE(ack->has_hello_ack());
  EXPECT_EQ(ack->hello_ack().auth_proof().size(), 32u);
  pb::Envelope proof;
  proof.mutable_auth_proof()->set_proof(std::string(32, '\0'));
  ASSERT_TRUE(WriteEnvelope(raw.native_handle(), proof));

  absl::StatusOr<pb::Envelope> reject = ReadEnvelope(raw.native_handle(), decoder);
  ASSERT_TRUE(reject.ok()) << reject.status();
  ASSERT_TRUE(reject->has_reject());
  EXPECT_EQ(reject->reject().code(), static_cast<uint32_t>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(reject->reject().reason(), HasSubstr("shared secret mismatch: dialer \"impostor\""));
  EXPECT_THAT(reject->reject().reason(), HasSubstr("failed the HMAC challenge"));
  EXPECT_TRUE(WaitForEof(raw.native_handle()));
  std::optional<absl::Status> failure = failures_.Pop();
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(accepted_.size(), 0u);
}

TEST_F(ControlTest, SecretOnListenerOnly) {
  HandshakeConfig listener_config = config_;
  listener_config.shared_secret = "s";
  const uint16_t port = StartListener(listener_config);
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("open"), config_);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(dialed.status().message(), HasSubstr("shared secret required by listener"));
  EXPECT_THAT(dialed.status().message(), HasSubstr("\"open\""));
}

TEST_F(ControlTest, SecretOnDialerOnly) {
  const uint16_t port = StartListener(config_);
  HandshakeConfig dialer_config = config_;
  dialer_config.shared_secret = "s";
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("closed"), dialer_config);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(dialed.status().message(), HasSubstr("sent a secret challenge"));
  EXPECT_THAT(dialed.status().message(), HasSubstr("listener has no shared secret"));
}

TEST_F(ControlTest, ResponderRefusalSurfacesAtDial) {
  refusal_ = absl::ResourceExhaustedError("too many peers (limit 3)");
  const uint16_t port = StartListener(config_);
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("d"), config_);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(dialed.status().message(),
              HasSubstr("rejected by peer " + Address(port) + ": too many peers (limit 3)"));
  EXPECT_EQ(accepted_.size(), 0u);
}

// --- dialing ----------------------------------------------------------------------------

TEST_F(ControlTest, DialResolvesNames) {
  const uint16_t port = StartListener(config_);
  absl::StatusOr<Accepted> dialed =
      Dial(io_, absl::StrCat("localhost:", port), NamedHello("d"), config_);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  dialed->connection->Close(absl::CancelledError("done"));
}

TEST_F(ControlTest, ListenResolvesNamesAndReportsErrors) {
  auto responder = [](const pb::Hello&) -> absl::StatusOr<pb::Hello> { return NamedHello("L"); };
  auto on_accept = [this](Accepted a) { accepted_.Push(std::move(a)); };
  absl::StatusOr<std::unique_ptr<Server>> by_name =
      Listen(io_, "localhost", 0, config_, responder, on_accept);
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  const uint16_t port = (*by_name)->port();
  servers_.push_back(*std::move(by_name));
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("d"), config_);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  dialed->connection->Close(absl::CancelledError("done"));

  absl::StatusOr<std::unique_ptr<Server>> taken =
      Listen(io_, "127.0.0.1", port, config_, responder, on_accept);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(taken.status().message(), HasSubstr(Address(port)));

  absl::StatusOr<std::unique_ptr<Server>> unknown =
      Listen(io_, "no-such-host.invalid", 0, config_, responder, on_accept);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("no-such-host.invalid"));
}

TEST_F(ControlTest, DialRejectsBadAddresses) {
  for (const char* address :
       {"", "nohost", "host:", ":80", "host:port", "host:70000", "h:0", "::1:80", "[::1"}) {
    absl::StatusOr<Accepted> dialed = Dial(io_, address, NamedHello("d"), config_);
    EXPECT_EQ(dialed.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_THAT(dialed.status().message(), HasSubstr("invalid address")) << address;
  }
  absl::StatusOr<HostPort> v6 = ParseHostPort("[::1]:5000");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 5000);
  EXPECT_TRUE(ParseHostPort("0.0.0.0:0", /*allow_port_zero=*/true).ok());
}

TEST_F(ControlTest, DialClosedPortIsUnavailable) {
  uint16_t port = 0;
  {
    tcp::acceptor acceptor(io_, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
    port = acceptor.local_endpoint().port();
  }
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("d"), config_);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(dialed.status().message(), HasSubstr(Address(port)));
}

TEST_F(ControlTest, DialTimesOutAgainstSilentAcceptor) {
  // The kernel completes TCP connects into the backlog; nobody ever answers.
  tcp::acceptor acceptor(io_, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
  const uint16_t port = acceptor.local_endpoint().port();
  config_.timeout = absl::Seconds(1);
  const absl::Time start = absl::Now();
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("d"), config_);
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(dialed.status().message(), HasSubstr(Address(port)));
  EXPECT_THAT(dialed.status().message(), HasSubstr("HelloAck"));
  EXPECT_GE(took, absl::Milliseconds(900));
  EXPECT_LT(took, absl::Seconds(1) + kWait);
}

TEST_F(ControlTest, ListenerDropsDialerThatNeverSpeaks) {
  config_.timeout = absl::Seconds(1);
  const uint16_t port = StartListener(config_);
  tcp::socket raw(io_);
  boost::system::error_code error;
  raw.connect(tcp::endpoint(asio::ip::address_v4::loopback(), port), error);
  ASSERT_FALSE(error) << error.message();
  EXPECT_TRUE(WaitForEof(raw.native_handle()));
  std::optional<absl::Status> failure = failures_.Pop();
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(failure->message(), HasSubstr("within 1s"));
  EXPECT_THAT(failure->message(), HasSubstr("waiting for Hello"));
}

TEST_F(ControlTest, StoppedServerRefusesDials) {
  const uint16_t port = StartListener(config_);
  servers_.back()->Stop();
  servers_.back()->Stop();  // idempotent
  absl::StatusOr<Accepted> dialed = Dial(io_, Address(port), NamedHello("d"), config_);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kUnavailable);
}

// --- established connections ------------------------------------------------------------

TEST_F(ControlTest, ConcurrentSendersKeepPerSenderOrderBothWays) {
  auto pair = ConnectPair(config_);
  Accepted& dialer = pair.first;
  Accepted& listener = pair.second;
  ASSERT_TRUE(dialer.connection && listener.connection);
  constexpr uint64_t kPerThread = 1000;

  struct Inbox {
    Mutex mu;
    CondVar cv;
    std::vector<uint64_t> ids ABSL_GUARDED_BY(mu);
    void Add(const pb::Envelope& e) {
      MutexLock lock(&mu);
      ids.push_back(e.notify().transfer_id());
      cv.SignalAll();
    }
    bool WaitFor(size_t n) {
      const absl::Time deadline = absl::Now() + kWait;
      MutexLock lock(&mu);
      while (ids.size() < n) {
        if (!cv.WaitUntil(&mu, deadline) && ids.size() < n) return false;
      }
      return true;
    }
    std::vector<uint64_t> Take() {
      MutexLock lock(&mu);
      return ids;
    }
  };
  Inbox at_dialer, at_listener;
  CloseRecorder closes;
  dialer.connection->Start([&](const pb::Envelope& e) { at_dialer.Add(e); }, closes.Handler(),
                           absl::Milliseconds(50), absl::Seconds(10));
  listener.connection->Start([&](const pb::Envelope& e) { at_listener.Add(e); }, closes.Handler(),
                             absl::Milliseconds(50), absl::Seconds(10));

  auto send_all = [&](Connection* connection, uint64_t sender) {
    for (uint64_t i = 0; i < kPerThread; ++i) {
      ASSERT_TRUE(connection->Send(MakeNotify((sender << 32) | i)).ok());
    }
  };
  std::vector<std::thread> senders;
  senders.emplace_back(send_all, dialer.connection.get(), 1);
  senders.emplace_back(send_all, dialer.connection.get(), 2);
  senders.emplace_back(send_all, listener.connection.get(), 3);
  senders.emplace_back(send_all, listener.connection.get(), 4);
  for (std::thread& t : senders) t.join();

  ASSERT_TRUE(at_listener.WaitFor(2 * kPerThread));
  ASSERT_TRUE(at_dialer.WaitFor(2 * kPerThread));
  auto check = [&](const std::vector<uint64_t>& ids, uint64_t a, uint64_t b) {
    EXPECT_EQ(ids.size(), 2 * kPerThread);
    uint64_t next[2] = {0, 0};
    for (uint64_t id : ids) {
      const uint64_t sender = id >> 32;
      ASSERT_TRUE(sender == a || sender == b) << id;
      uint64_t& expected = next[sender == a ? 0 : 1];
      ASSERT_EQ(id & 0xffffffffu, expected) << "sender " << sender;
      ++expected;
    }
  };
  check(at_listener.Take(), 1, 2);
  check(at_dialer.Take(), 3, 4);
  EXPECT_EQ(closes.statuses.size(), 0u);
  dialer.connection->Close(absl::CancelledError("done"));
  listener.connection->Close(absl::CancelledError("done"));
}

TEST_F(ControlTest, HeartbeatsKeepAQuietConnectionAlive) {
  auto pair = ConnectPair(config_);
  Accepted& dialer = pair.first;
  Accepted& listener = pair.second;
  ASSERT_TRUE(dialer.connection && listener.connection);
  CloseRecorder closes;
  std::atomic<int> delivered{0};  // heartbeats must not reach the handler
  dialer.connection->Start([&](const pb::Envelope&) { ++delivered; }, closes.Handler(),
                           absl::Milliseconds(100), absl::Seconds(2));
  listener.connection->Start([&](const pb::Envelope&) { ++delivered; }, closes.Handler(),
                             absl::Milliseconds(100), absl::Seconds(2));
  EXPECT_FALSE(closes.statuses.Pop(absl::Seconds(4)).has_value());
  EXPECT_EQ(delivered.load(), 0);
  dialer.connection->Close(absl::CancelledError("done"));
  std::optional<absl::Status> a = closes.statuses.Pop();
  std::optional<absl::Status> b = closes.statuses.Pop();
  EXPECT_TRUE(a.has_value() && b.has_value());
}

// Accepts one dial and completes the no-secret handshake by hand; the returned socket then
// does whatever the test wants (nothing, garbage, ...).
class RawListener {
 public:
  explicit RawListener(asio::io_context& io)
      : acceptor_(io, tcp::endpoint(asio::ip::address_v4::loopback(), 0)), socket_(io) {}
  uint16_t port() const { return acceptor_.local_endpoint().port(); }

  absl::StatusOr<Accepted> DialAndHandshake(asio::io_context& io, const HandshakeConfig& config) {
    auto dial = std::async(std::launch::async, [&] {
      return Dial(io, LoopbackAddress(port()), NamedHello("d"), config);
    });
    boost::system::error_code error;
    acceptor_.accept(socket_, error);
    if (error) return absl::InternalError(error.message());
    absl::StatusOr<pb::Envelope> hello = ReadEnvelope(fd(), decoder_);
    if (!hello.ok()) return hello.status();
    pb::Envelope ack;
    *ack.mutable_hello_ack()->mutable_hello() = NamedHello("raw");
    ack.mutable_hello_ack()->mutable_hello()->set_protocol_version(kProtocolVersion);
    ack.mutable_hello_ack()->mutable_hello()->set_compat_hash(config.compat_hash);
    if (!WriteEnvelope(fd(), ack)) return absl::InternalError("raw write failed");
    return dial.get();
  }
  int fd() { return socket_.native_handle(); }
  FrameDecoder& decoder() { return decoder_; }

 private:
  tcp::acceptor acceptor_;
  tcp::socket socket_;
  FrameDecoder decoder_{1 << 20};
};

TEST_F(ControlTest, SilentPeerIsDeclaredDeadAfterLease) {
  RawListener raw(io_);
  absl::StatusOr<Accepted> dialed = raw.DialAndHandshake(io_, config_);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  CloseRecorder closes;
  const absl::Time start = absl::Now();
  dialed->connection->Start([](const pb::Envelope&) {}, closes.Handler(), absl::Milliseconds(100),
                            absl::Seconds(1));
  std::optional<absl::Status> closed = closes.statuses.Pop();
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(closed->message(), HasSubstr(absl::StrCat("peer 127.0.0.1:", raw.port(),
                                                        " silent for 1s; declared dead")));
  EXPECT_GE(took, absl::Milliseconds(900));
  // The raw peer saw heartbeats, then a Goodbye carrying the reason.
  absl::StatusOr<pb::Envelope> e = ReadEnvelope(raw.fd(), raw.decoder());
  while (e.ok() && e->has_heartbeat()) e = ReadEnvelope(raw.fd(), raw.decoder());
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE(e->has_goodbye());
  EXPECT_THAT(e->goodbye().reason(), HasSubstr("declared dead"));
  EXPECT_EQ(closes.statuses.size(), 0u);  // exactly once
}

TEST_F(ControlTest, OversizedFrameClosesConnection) {
  config_.max_frame_bytes = 64 << 10;
  RawListener raw(io_);
  absl::StatusOr<Accepted> dialed = raw.DialAndHandshake(io_, config_);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  CloseRecorder closes;
  dialed->connection->Start([](const pb::Envelope&) {}, closes.Handler(), absl::Seconds(1),
                            absl::Seconds(30));
  ASSERT_TRUE(WriteAll(raw.fd(), Header((64 << 10) + 1) + std::string(100, 'x')));
  std::optional<absl::Status> closed = closes.statuses.Pop();
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(closed->message(), HasSubstr("protocol error from peer 127.0.0.1:"));
  EXPECT_THAT(closed->message(), HasSubstr("65537 bytes"));
  EXPECT_THAT(closed->message(), HasSubstr("limit of 65536 bytes"));
  EXPECT_THAT(dialed->connection->Send(MakeNotify(1)).code(),
              absl::StatusCode::kFailedPrecondition);
}

TEST_F(ControlTest, GarbageFrameClosesConnection) {
  RawListener raw(io_);
  absl::StatusOr<Accepted> dialed = raw.DialAndHandshake(io_, config_);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  CloseRecorder closes;
  Queue<pb::Envelope> received;
  dialed->connection->Start([&](const pb::Envelope& e) { received.Push(e); }, closes.Handler(),
                            absl::Seconds(1), absl::Seconds(30));
  // A valid Notify, then garbage in the same write.
  absl::StatusOr<std::string> good = EncodeFrame(MakeNotify(77), 1 << 20);
  ASSERT_TRUE(good.ok());
  ASSERT_TRUE(WriteAll(raw.fd(), *good + Header(6) + "\xff\xff\xff\xff\xff\xff"));
  std::optional<absl::Status> closed = closes.statuses.Pop();
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(closed->message(), HasSubstr("not a valid Envelope"));
  std::optional<pb::Envelope> first = received.Pop(absl::ZeroDuration());
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->notify().transfer_id(), 77u);
}

TEST_F(ControlTest, RejectAfterHandshakeClosesDialerConnection) {
  RawListener raw(io_);
  absl::StatusOr<Accepted> dialed = raw.DialAndHandshake(io_, config_);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  CloseRecorder closes;
  dialed->connection->Start([](const pb::Envelope&) {}, closes.Handler(), absl::Seconds(1),
                            absl::Seconds(30));
  ASSERT_TRUE(WriteEnvelope(raw.fd(), MakeReject(absl::PermissionDeniedError("bad proof"))));
  std::optional<absl::Status> closed = closes.statuses.Pop();
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(closed->message(), HasSubstr("rejected by peer 127.0.0.1:"));
  EXPECT_THAT(closed->message(), HasSubstr("bad proof"));
}

TEST_F(ControlTest, TruncatedFrameAtEofIsReported) {
  RawListener raw(io_);
  absl::StatusOr<Accepted> dialed = raw.DialAndHandshake(io_, config_);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  CloseRecorder closes;
  dialed->connection->Start([](const pb::Envelope&) {}, closes.Handler(), absl::Seconds(1),
                            absl::Seconds(30));
  ASSERT_TRUE(WriteAll(raw.fd(), Header(100) + "abc"));
  ::shutdown(raw.fd(), SHUT_WR);
  std::optional<absl::Status> closed = closes.statuses.Pop();
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(closed->message(), HasSubstr("mid-frame"));
  EXPECT_THAT(closed->message(), HasSubstr("got 3 of 100"));
}

TEST_F(ControlTest, GoodbyePropagatesReasonAndCloseRunsOnce) {
  auto pair = ConnectPair(config_);
  Accepted& dialer = pair.first;
  Accepted& listener = pair.second;
  ASSERT_TRUE(dialer.connection && listener.connection);
  CloseRecorder dialer_closes, listener_closes;
  dialer.connection->Start([](const pb::Envelope&) {}, dialer_closes.Handler(),
                           absl::Milliseconds(100), absl::Seconds(10));
  listener.connection->Start([](const pb::Envelope&) {}, listener_closes.Handler(),
                             absl::Milliseconds(100), absl::Seconds(10));

  // Racing local closes from two threads: the handler still runs once.
  std::thread other(
      [&] { listener.connection->Close(absl::CancelledError("engine shutting down")); });
  listener.connection->Close(absl::CancelledError("engine shutting down"));
  other.join();
  std::optional<absl::Status> local = listener_closes.statuses.Pop();
  ASSERT_TRUE(local.has_value());
  EXPECT_EQ(*local, absl::CancelledError("engine shutting down"));

  std::optional<absl::Status> remote = dialer_closes.statuses.Pop();
  ASSERT_TRUE(remote.has_value());
  EXPECT_EQ(remote->code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(remote->message(), HasSubstr("peer closed: engine shutting down"));

  dialer.connection->Close(absl::CancelledError("again"));  // already closed: no handler
  EXPECT_FALSE(dialer_closes.statuses.Pop(absl::Milliseconds(200)).has_value());
  EXPECT_FALSE(listener_closes.statuses.Pop(absl::Milliseconds(200)).has_value());
  absl::Status send = dialer.connection->Send(MakeNotify(1));
  EXPECT_EQ(send.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(send.message(), HasSubstr("engine shutting down"));
}

TEST_F(ControlTest, CloseBeforeStartRunsHandlerAtStart) {
  auto pair = ConnectPair(config_);
  Accepted& dialer = pair.first;
  Accepted& listener = pair.second;
  ASSERT_TRUE(dialer.connection && listener.connection);
  dialer.connection->Close(absl::AbortedError("changed my mind"));
  CloseRecorder closes;
  dialer.connection->Start([](const pb::Envelope&) {}, closes.Handler(), absl::Seconds(1),
                           absl::Seconds(10));
  std::optional<absl::Status> closed = closes.statuses.Pop(absl::ZeroDuration());
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->code(), absl::StatusCode::kAborted);

  // The listener side, started later, sees the Goodbye.
  CloseRecorder listener_closes;
  listener.connection->Start([](const pb::Envelope&) {}, listener_closes.Handler(),
                             absl::Seconds(1), absl::Seconds(10));
  closed = listener_closes.statuses.Pop();
  ASSERT_TRUE(closed.has_value());
  EXPECT_THAT(closed->message(), HasSubstr("peer closed: changed my mind"));
}

TEST_F(ControlTest, SendRejectsOversizedMessage) {
  config_.max_frame_bytes = 8192;
  auto pair = ConnectPair(config_);
  Accepted& dialer = pair.first;
  ASSERT_TRUE(dialer.connection && pair.second.connection);
  pb::Envelope big = MakeNotify(1);
  big.mutable_notify()->set_payload(std::string(10000, 'x'));
  absl::Status status = dialer.connection->Send(big);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("8192"));
}

// Connections left open while their io_context is stopped and destroyed must not be used
// after free (run under ASan).
TEST(ControlLifetimeTest, StoppedIoContextWithLiveConnections) {
  auto io = std::make_unique<asio::io_context>();
  auto work = std::make_unique<asio::executor_work_guard<asio::io_context::executor_type>>(
      io->get_executor());
  std::thread runner([&] { io->run(); });
  HandshakeConfig config;
  config.compat_hash = CompatibilityHash(0);
  Queue<Accepted> accepted;
  absl::StatusOr<std::unique_ptr<Server>> server = Listen(
      *io, "127.0.0.1", 0, config, [](const pb::Hello&) { return NamedHello("L"); },
      [&](Accepted a) { accepted.Push(std::move(a)); });
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<Accepted> dialed =
      Dial(*io, absl::StrCat("127.0.0.1:", (*server)->port()), NamedHello("D"), config);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  std::optional<Accepted> other = accepted.Pop();
  ASSERT_TRUE(other.has_value());
  std::atomic<int> closes{0};
  dialed->connection->Start([](const pb::Envelope&) {}, [&](const absl::Status&) { ++closes; },
                            absl::Milliseconds(10), absl::Seconds(10));
  other->connection->Start([](const pb::Envelope&) {}, [&](const absl::Status&) { ++closes; },
                           absl::Milliseconds(10), absl::Seconds(10));
  ASSERT_TRUE(dialed->connection->Send(MakeNotify(1)).ok());
  absl::SleepFor(absl::Milliseconds(100));
  work.reset();
  io->stop();
  runner.join();
  // Close with the io_context stopped: the handler still runs, here.
  dialed->connection->Close(absl::CancelledError("bye"));
  EXPECT_EQ(closes.load(), 1);
  EXPECT_EQ(dialed->connection->Send(MakeNotify(2)).code(), absl::StatusCode::kFailedPrecondition);
  dialed->connection.reset();
  other->connection.reset();  // still started: only its pending handlers hold it now
  (*server)->Stop();
  server->reset();
  io.reset();  // destroys those handlers and, with them, the connection
}

}  // namespace
}  // namespace kvwire::control
