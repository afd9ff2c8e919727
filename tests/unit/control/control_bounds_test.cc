// Control-channel bounds over real loopback sockets: a peer that stops reading is closed at
// the send-queue limit instead of growing memory; session tokens are issued only once the
// peer is authenticated and revoked when a handshake fails after issuing one.
#include <sys/socket.h>

#include <atomic>
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

#include "src/control/control.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "src/util/mutex.h"

namespace kvwire::control {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(20);

absl::StatusOr<pb::Envelope> ReadEnvelope(int fd, FrameDecoder& decoder) {
  const absl::Time deadline = absl::Now() + kWait;
  pb::Envelope envelope;
  while (!decoder.Next(&envelope)) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("raw read timed out");
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
    char buffer[4096];
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) return absl::UnavailableError("raw read: EOF or error");
    if (absl::Status s = decoder.Feed(buffer, static_cast<size_t>(n)); !s.ok()) return s;
  }
  return envelope;
}

bool WriteEnvelope(int fd, const pb::Envelope& envelope) {
  absl::StatusOr<std::string> frame = EncodeFrame(envelope, 1 << 20);
  if (!frame.ok()) return false;
  return ::send(fd, frame->data(), frame->size(), MSG_NOSIGNAL) ==
         static_cast<ssize_t>(frame->size());
}

class Tokens {
 public:
  absl::StatusOr<std::string> Issue() {
    MutexLock lock(&mu_);
    const std::string token = absl::StrCat("token-", ++issued_);
    live_.push_back(token);
    return token;
  }
  void Revoke(const std::string& token) {
    MutexLock lock(&mu_);
    live_.erase(std::remove(live_.begin(), live_.end(), token), live_.end());
  }
  std::vector<std::string> live() {
    MutexLock lock(&mu_);
    return live_;
  }
  int issued() {
    MutexLock lock(&mu_);
    return issued_;
  }
  void Install(HandshakeConfig& config) {
    config.issue_token = [this] { return Issue(); };
    config.revoke_token = [this](const std::string& t) { Revoke(t); };
  }

 private:
  Mutex mu_;
  int issued_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> live_ ABSL_GUARDED_BY(mu_);
};

class ControlBoundsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    thread_ = std::thread([this] { io_.run(); });
    config_.compat_hash = CompatibilityHash(0);
    config_.timeout = absl::Seconds(10);
  }
  void TearDown() override {
    work_.reset();
    io_.stop();
    thread_.join();
  }
  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_{
      io_.get_executor()};
  std::thread thread_;
  HandshakeConfig config_;
};

TEST_F(ControlBoundsTest, PeerThatStopsReadingIsClosedAtTheSendQueueLimit) {
  config_.max_frame_bytes = 4096;
  config_.max_send_queue_bytes = 64 << 10;
  // A raw listener that completes the handshake, then never reads again. A small receive
  // buffer keeps the kernel from absorbing much.
  tcp::acceptor acceptor(io_, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
  acceptor.set_option(asio::socket_base::receive_buffer_size(4096));
  auto dial = std::async(std::launch::async, [&] {
    return Dial(io_, absl::StrCat("127.0.0.1:", acceptor.local_endpoint().port()), pb::Hello(),
                config_);
  });
  tcp::socket raw(io_);
  acceptor.accept(raw);
  FrameDecoder decoder(1 << 20);
  ASSERT_TRUE(ReadEnvelope(raw.native_handle(), decoder).ok());
  pb::Envelope ack;
  ack.mutable_hello_ack()->mutable_hello()->set_protocol_version(kProtocolVersion);
  ack.mutable_hello_ack()->mutable_hello()->set_compat_hash(config_.compat_hash);
  ASSERT_TRUE(WriteEnvelope(raw.native_handle(), ack));
  absl::StatusOr<Accepted> dialed = dial.get();
  ASSERT_TRUE(dialed.ok()) << dialed.status();

  std::promise<absl::Status> closed;
  dialed->connection->Start([](const pb::Envelope&) {},
                            [&](const absl::Status& s) { closed.set_value(s); },
                            absl::InfiniteDuration(), absl::InfiniteDuration());
  pb::Envelope notify;
  notify.mutable_notify()->set_payload(std::string(1000, 'x'));
  absl::Status sent;
  int count = 0;
  // Bounded: 100 MB would be far past any socket buffering.
  for (; count < 100000 && sent.ok(); ++count) sent = dialed->connection->Send(notify);
  ASSERT_FALSE(sent.ok()) << "sent " << count << " messages to a peer that does not read";
  EXPECT_EQ(sent.code(), absl::StatusCode::kResourceExhausted) << sent;
  EXPECT_THAT(sent.message(), HasSubstr("is not reading its control channel"));
  EXPECT_THAT(sent.message(), HasSubstr("send queue limit of 65536 bytes"));
  std::future<absl::Status> done = closed.get_future();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(done.get().code(), absl::StatusCode::kResourceExhausted);
  // Once closed, further sends fail at once rather than queue.
  EXPECT_EQ(dialed->connection->Send(notify).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ControlBoundsTest, TokensAreIssuedOnlyAfterBothProofsAndTravelAfterThem) {
  config_.shared_secret = "s";
  Tokens listener_tokens, dialer_tokens;
  HandshakeConfig listener_config = config_;
  listener_tokens.Install(listener_config);
  std::promise<Accepted> accepted;
  auto server = Listen(
      io_, "127.0.0.1", 0, listener_config,
      [](const pb::Hello&) -> absl::StatusOr<pb::Hello> { return pb::Hello(); },
      [&](Accepted a) { accepted.set_value(std::move(a)); });
  ASSERT_TRUE(server.ok()) << server.status();
  HandshakeConfig dialer_config = config_;
  dialer_tokens.Install(dialer_config);
  pb::Hello hello;
  hello.set_session_token("ignored: the handshake owns this field");
  absl::StatusOr<Accepted> dialed =
      Dial(io_, absl::StrCat("127.0.0.1:", (*server)->port()), hello, dialer_config);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  std::future<Accepted> at_listener = accepted.get_future();
  ASSERT_EQ(at_listener.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  Accepted listener_side = at_listener.get();
  // Each side learned the other's issued token, and owns its own.
  EXPECT_EQ(dialed->local_token, "token-1");
  EXPECT_EQ(listener_side.local_token, "token-1");
  EXPECT_EQ(dialed->remote_hello.session_token(), listener_side.local_token);
  EXPECT_EQ(listener_side.remote_hello.session_token(), dialed->local_token);
  EXPECT_EQ(listener_tokens.live().size(), 1u);
  EXPECT_EQ(dialer_tokens.live().size(), 1u);
  dialed->connection->Close(absl::CancelledError("done"));
  listener_side.connection->Close(absl::CancelledError("done"));
}

TEST_F(ControlBoundsTest, AHandshakeThatFailsAfterIssuingRevokesTheToken) {
  // A raw listener that proves the secret correctly (it knows it) but then never sends
  // Welcome: the dialer issued its token before sending AuthProof, and must revoke it.
  config_.shared_secret = "s";
  config_.timeout = absl::Seconds(1);
  Tokens dialer_tokens;
  HandshakeConfig dialer_config = config_;
  dialer_tokens.Install(dialer_config);
  tcp::acceptor acceptor(io_, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
  auto dial = std::async(std::launch::async, [&] {
    return Dial(io_, absl::StrCat("127.0.0.1:", acceptor.local_endpoint().port()), pb::Hello(),
                dialer_config);
  });
  tcp::socket raw(io_);
  acceptor.accept(raw);
  FrameDecoder decoder(1 << 20);
  absl::StatusOr<pb::Envelope> hello = ReadEnvelope(raw.native_handle(), decoder);
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_TRUE(hello->hello().session_token().empty());
  pb::Envelope ack;
  pb::Hello* mine = ack.mutable_hello_ack()->mutable_hello();
  mine->set_protocol_version(kProtocolVersion);
  mine->set_compat_hash(config_.compat_hash);
  mine->set_has_secret(true);
  mine->set_auth_nonce(std::string(32, 'L'));
  ack.mutable_hello_ack()->set_auth_proof(
      ListenerProof("s", hello->hello().auth_nonce(), mine->auth_nonce()));
  ASSERT_TRUE(WriteEnvelope(raw.native_handle(), ack));
  absl::StatusOr<pb::Envelope> proof = ReadEnvelope(raw.native_handle(), decoder);
  ASSERT_TRUE(proof.ok()) << proof.status();
  ASSERT_TRUE(proof->has_auth_proof());
  EXPECT_EQ(proof->auth_proof().session_token(), "token-1");
  // No Welcome: the dialer gives up at its deadline.
  absl::StatusOr<Accepted> dialed = dial.get();
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kDeadlineExceeded) << dialed.status();
  EXPECT_THAT(dialed.status().message(), HasSubstr("waiting for Welcome"));
  EXPECT_EQ(dialer_tokens.issued(), 1);
  EXPECT_TRUE(dialer_tokens.live().empty());
}

}  // namespace
}  // namespace kvwire::control
