// Hostile peers on the control channel: a dialer or listener that does not know the shared
// secret, abandons, trickles or floods handshakes, or sends what a correct engine never sends.
// Each attacker speaks the protocol by hand over raw loopback sockets; the targets are real
// engines (in this process or a kvwire_test_peer process). After each attack the target must
// still serve a legitimate peer byte-exact.

// FailingCsprng below replaces OpenSSL's RAND method, an API OpenSSL 3 deprecates.
#define OPENSSL_SUPPRESS_DEPRECATED

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <dirent.h>
#include <optional>
#include <poll.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/rand.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "kvwire/stats.h"
#include "proto/kvwire.pb.h"
#include "src/control/control.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "src/util/mutex.h"
#include "tests/integration/peer_process.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/fake_target_hooks.h"
#include "transport/tcp/tcp_transport.h"

namespace kvwire::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kRegionBytes = 256 << 10;
constexpr absl::Duration kWait = absl::Seconds(20);

// --- raw sockets (every call bounded by a deadline) -------------------------------------

class RawSocket {
 public:
  RawSocket() = default;
  explicit RawSocket(int fd) : fd_(fd) {}
  RawSocket(RawSocket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  RawSocket& operator=(RawSocket&& other) noexcept {
    if (this != &other) {
      Close();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~RawSocket() { Close(); }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd() const { return fd_; }

  // Connects to "127.0.0.1:port" (the only form the engines here listen on), from `source`
  // (another loopback address stands for another host).
  static absl::StatusOr<RawSocket> Dial(const std::string& address, const char* source = nullptr) {
    const size_t colon = address.rfind(':');
    uint32_t port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
      return absl::InvalidArgumentError(absl::StrCat("bad address ", address));
    }
    RawSocket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (s.fd() < 0) return absl::InternalError("socket()");
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (source != nullptr) {
      sockaddr_in from{};
      from.sin_family = AF_INET;
      if (::inet_pton(AF_INET, source, &from.sin_addr) != 1 ||
          ::bind(s.fd(), reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
        return absl::InternalError(absl::StrCat("bind to ", source, ": errno ", errno));
      }
    }
    if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      return absl::UnavailableError(absl::StrCat("connect ", address, ": errno ", errno));
    }
    return s;
  }

  bool Write(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  bool Send(const pb::Envelope& envelope) {
    absl::StatusOr<std::string> frame = control::EncodeFrame(envelope, 1 << 20);
    return frame.ok() && Write(*frame);
  }

  absl::StatusOr<pb::Envelope> Read(absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    pb::Envelope envelope;
    while (!decoder_.Next(&envelope)) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("raw read timed out");
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
      char buffer[4096];
      const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n == 0) return absl::UnavailableError("raw read: EOF");
      if (n < 0) return absl::UnavailableError(absl::StrCat("raw read: errno ", errno));
      if (absl::Status s = decoder_.Feed(buffer, static_cast<size_t>(n)); !s.ok()) return s;
    }
    return envelope;
  }

  // True once the other side closed (EOF or reset) within `timeout`; data is discarded.
  bool WaitForEof(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buffer[4096];
      if (::recv(fd_, buffer, sizeof(buffer), 0) <= 0) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
  control::FrameDecoder decoder_{1 << 20};
};

// A listening raw socket on 127.0.0.1 (a hostile listener).
class RawAcceptor {
 public:
  RawAcceptor() {
    fd_ = RawSocket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    if (::bind(fd_.fd(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
        ::listen(fd_.fd(), 8) != 0 ||
        ::getsockname(fd_.fd(), reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      ADD_FAILURE() << "raw listener setup failed: errno " << errno;
    }
    port_ = ntohs(sa.sin_port);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  absl::StatusOr<RawSocket> Accept(absl::Duration timeout = kWait) {
    pollfd p{fd_.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) <= 0) {
      return absl::DeadlineExceededError("nobody dialed the raw listener");
    }
    const int fd = ::accept4(fd_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return absl::InternalError("accept");
    return RawSocket(fd);
  }

 private:
  RawSocket fd_;
  uint16_t port_ = 0;
};

// A Hello as an engine with `secret` set would send it, minus any honesty.
pb::Envelope ForgedHello(const std::string& name, bool with_secret) {
  pb::Envelope envelope;
  pb::Hello* hello = envelope.mutable_hello();
  hello->set_engine_name(name);
  hello->set_protocol_version(control::kProtocolVersion);
  hello->set_compat_hash(control::CompatibilityHash(0));
  hello->set_transport_preference("tcp");
  hello->set_has_secret(with_secret);
  if (with_secret) hello->set_auth_nonce(std::string(32, 'n'));
  return envelope;
}

std::string TransportEndpointOf(const pb::Hello& hello, const std::string& kind) {
  for (const pb::TransportEndpoint& t : hello.transports()) {
    if (t.kind() == kind) return t.endpoint();
  }
  return "";
}
std::string TcpEndpointOf(const pb::Hello& hello) { return TransportEndpointOf(hello, "tcp"); }

// --- presenting a token on a tcp data port ---------------------------------------------

// A tcp data connection held open with one token, for READs at chosen moments.
class HeldDataConnection {
 public:
  HeldDataConnection(const std::string& endpoint, const std::string& token) {
    auto tcp = transport::CreateTcpTransport(transport::TcpTransportOptions(), &hooks_);
    if (!tcp.ok()) {
      open_ = tcp.status();
      return;
    }
    tcp_ = *std::move(tcp);
    transport::PeerLink link;
    link.peer = 1;
    link.peer_name = "victim";
    link.remote_endpoint = endpoint;
    link.token = token;
    link.lanes = 1;
    link.deadline = absl::Now() + absl::Seconds(10);
    auto channel = tcp_->Connect(link);
    if (!channel.ok()) {
      open_ = channel.status();
      return;
    }
    channel_ = *std::move(channel);
  }
  ~HeldDataConnection() {
    if (channel_ != nullptr) channel_->Close(absl::CancelledError("thief done"));
    channel_.reset();
    if (tcp_ != nullptr) tcp_->Shutdown();
  }
  const absl::Status& open() const { return open_; }

  absl::Status Read(RegionId region, uint64_t length, std::byte* out) {
    if (channel_ == nullptr) return open_;
    transport::PostRequest request;
    request.transfer_id = ++transfer_id_;
    request.kind = OpKind::kRead;
    request.ops.push_back(transport::WireOp{out, region, 0, length});
    request.cancelled = std::make_shared<std::atomic<bool>>(false);
    auto done = std::make_shared<std::pair<Mutex, std::optional<absl::Status>>>();
    auto done_cv = std::make_shared<CondVar>();
    channel_->Post(std::move(request), [done, done_cv](absl::Status s) {
      MutexLock lock(&done->first);
      done->second = std::move(s);
      done_cv->SignalAll();
    });
    const absl::Time deadline = absl::Now() + kWait;
    MutexLock lock(&done->first);
    while (!done->second.has_value() && absl::Now() < deadline) {
      done_cv->WaitUntil(&done->first, deadline);
    }
    return done->second.value_or(absl::DeadlineExceededError("READ never completed"));
  }

 private:
  FakeTargetHooks hooks_;  // the thief serves nothing
  std::unique_ptr<transport::Transport> tcp_;
  std::unique_ptr<transport::Channel> channel_;
  absl::Status open_;
  TransferId transfer_id_ = 0;
};

// Opens a tcp data connection to `endpoint` presenting `token`, and READs `length` bytes of
// `region` into `out`: what a peer holding a live token can do.
absl::Status ReadWithToken(const std::string& endpoint, const std::string& token, RegionId region,
                           uint64_t length, std::byte* out) {
  HeldDataConnection connection(endpoint, token);
  if (!connection.open().ok()) return connection.open();
  return connection.Read(region, length, out);
}

// A legitimate engine READs all of `region` (exported to all peers, pattern `seed`/`index`) of
// the engine at `address` and checks every byte.
void ExpectLegitimateReadIsExact(const std::string& address, const std::string& secret,
                                 RegionId region, uint64_t seed, uint64_t index) {
  EngineOptions options;
  options.name = "legit";
  options.shared_secret = secret;
  options.transport = "tcp";
  auto engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<std::byte> buf(kRegionBytes);
  auto local = (*engine)->RegisterMemory(buf.data(), buf.size());
  ASSERT_TRUE(local.ok()) << local.status();
  auto peer = (*engine)->Connect(address);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE((*engine)->WaitForRemoteRegion(*peer, region, kWait).ok());
  auto id = (*engine)->Transfer(*peer, OpKind::kRead, {Op{*local, 0, region, 0, kRegionBytes}});
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE((*engine)->Wait(*id, kWait).ok());
  for (uint64_t i = 0; i < kRegionBytes; ++i) {
    ASSERT_EQ(buf[i], PatternByte(seed, index, i)) << "byte " << i;
  }
}

std::unique_ptr<PeerProcess> StartTarget(const std::string& secret, uint64_t seed) {
  auto target = PeerProcess::Start({"--transport=tcp", "--regions=1",
                                    absl::StrCat("--region_bytes=", kRegionBytes),
                                    absl::StrCat("--seed=", seed), "--secret=" + secret});
  EXPECT_TRUE(target.ok()) << target.status();
  return target.ok() ? *std::move(target) : nullptr;
}

// --- the secret bypass ------------------------------------------------------------------

// A dialer that knows no secret sends Hello with a nonce, takes whatever HelloAck gives it and
// never proves anything. Before the fix HelloAck carried a session token that was already
// live, and that token READ every region exported to all peers over the tcp data port.
TEST(HostileHandshakeTest, UnprovenDialerGetsNoLiveTokenAndReadsNothing) {
  std::unique_ptr<PeerProcess> target = StartTarget("s3cret", 11);
  ASSERT_NE(target, nullptr);
  const RegionId region = target->regions()[0];

  auto thief = RawSocket::Dial(target->address());
  ASSERT_TRUE(thief.ok()) << thief.status();
  ASSERT_TRUE(thief->Send(ForgedHello("thief", /*with_secret=*/true)));
  absl::StatusOr<pb::Envelope> ack = thief->Read();
  ASSERT_TRUE(ack.ok()) << ack.status();
  ASSERT_TRUE(ack->has_hello_ack());
  const std::string token = ack->hello_ack().hello().session_token();
  const std::string endpoint = TcpEndpointOf(ack->hello_ack().hello());
  ASSERT_FALSE(endpoint.empty());
  EXPECT_EQ(token, "") << "HelloAck hands a session token to a dialer that has not proven the "
                          "secret";

  // Present it (or nothing, if it got none) on the data port while the handshake is pending.
  std::vector<std::byte> stolen(kRegionBytes);
  absl::Status read = ReadWithToken(endpoint, token, region, kRegionBytes, stolen.data());
  EXPECT_FALSE(read.ok()) << "READ of an exported region with the token of an unproven "
                             "handshake succeeded; first byte "
                          << static_cast<int>(stolen[0]);
  EXPECT_EQ(read.code(), absl::StatusCode::kUnauthenticated) << read;
  thief->Close();

  ExpectLegitimateReadIsExact(target->address(), "s3cret", region, 11, 0);
  target->Stop();
}

// --- in-process targets: what a failed handshake leaves behind -------------------------

// An engine listening on loopback with one region of pattern `seed` exported to all peers.
struct Target {
  // Before the engine, so that it outlives it (the engine's destruction joins the threads that
  // served it; ThreadSanitizer sees no other order between their reads and the free).
  std::vector<std::byte> memory = std::vector<std::byte>(kRegionBytes);
  std::unique_ptr<Engine> engine;
  RegionId region = 0;
  uint64_t seed = 0;

  static std::unique_ptr<Target> Start(EngineOptions options, uint64_t seed) {
    auto target = std::make_unique<Target>();
    target->seed = seed;
    options.transport = "tcp";
    auto engine = Engine::Create(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return nullptr;
    target->engine = *std::move(engine);
    FillPattern(target->memory.data(), kRegionBytes, seed, 0);
    RegionOptions exported;
    exported.export_to_all_peers = true;
    auto region = target->engine->RegisterMemory(target->memory.data(), kRegionBytes, exported);
    EXPECT_TRUE(region.ok()) << region.status();
    target->region = region.value_or(0);
    return target;
  }
  ControlStats control() const { return engine->Stats().control; }
  void ExpectServesLegitimatePeer(const std::string& secret) const {
    ExpectLegitimateReadIsExact(engine->address(), secret, region, seed, 0);
  }
};

// Polls `done` until true or the deadline; every wait in these tests is bounded.
template <typename F>
bool Eventually(F done, absl::Duration timeout = kWait) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

int ThreadCount() {
  int n = 0;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(dir)) n += e->d_name[0] != '.';
    ::closedir(dir);
  }
  return n;
}

EngineOptions ShortDeadlines(const std::string& secret) {
  EngineOptions options;
  options.shared_secret = secret;
  options.connect_timeout = absl::Seconds(1);
  return options;
}

// A victim engine (a Target that knows the secret) dialing a raw hostile listener or relay
// from a thread of its own: the test plays the other side, then Join()s and judges
// `connected`.
struct DialingVictim {
  static std::unique_ptr<DialingVictim> Start(const std::string& name, uint64_t seed) {
    EngineOptions options;
    options.name = name;
    options.shared_secret = "s3cret";
    options.connect_timeout = absl::Seconds(5);
    auto victim = std::make_unique<DialingVictim>();
    victim->target = Target::Start(options, seed);
    if (victim->target == nullptr) return nullptr;
    victim->dialer = std::thread(
        [v = victim.get()] { v->connected = v->target->engine->Connect(v->hostile.address()); });
    return victim;
  }
  ~DialingVictim() { Join(); }
  void Join() {
    if (dialer.joinable()) dialer.join();
  }
  Engine& engine() { return *target->engine; }

  std::unique_ptr<Target> target;
  RawAcceptor hostile;
  std::optional<absl::StatusOr<PeerId>> connected;
  std::thread dialer;
};

// The mirror image: an engine dials a listener that knows no secret. Before the fix the
// engine's token was live before it had checked the listener's proof, and its Hello carried
// it, so the hostile listener could READ the dialer's exported regions.
TEST(HostileHandshakeTest, UnprovenListenerGetsNoLiveTokenAndReadsNothing) {
  std::unique_ptr<DialingVictim> victim = DialingVictim::Start("victim-dialer", 21);
  ASSERT_NE(victim, nullptr);
  absl::Status read = absl::UnknownError("not tried");
  std::string token = "<none>";
  {
    auto socket = victim->hostile.Accept();
    ASSERT_TRUE(socket.ok()) << socket.status();
    absl::StatusOr<pb::Envelope> hello = socket->Read();
    ASSERT_TRUE(hello.ok()) << hello.status();
    ASSERT_TRUE(hello->has_hello());
    token = hello->hello().session_token();
    std::vector<std::byte> stolen(kRegionBytes);
    // The dialer is blocked waiting for HelloAck: its side of the handshake is in progress.
    read = ReadWithToken(TcpEndpointOf(hello->hello()), token, victim->target->region, kRegionBytes,
                         stolen.data());
    // Answer with a proof it cannot compute.
    pb::Envelope ack;
    *ack.mutable_hello_ack()->mutable_hello() = ForgedHello("hostile-listener", true).hello();
    ack.mutable_hello_ack()->set_auth_proof(std::string(32, 'x'));
    EXPECT_TRUE(socket->Send(ack));
    EXPECT_TRUE(socket->WaitForEof(kWait));
  }
  victim->Join();
  EXPECT_EQ(token, "") << "the dialer's Hello carries its session token before the listener "
                          "proved the secret";
  EXPECT_FALSE(read.ok()) << "READ with the dialer's token before the listener proved anything "
                             "succeeded";
  ASSERT_TRUE(victim->connected.has_value());
  ASSERT_FALSE(victim->connected->ok());
  EXPECT_EQ(victim->connected->status().code(), absl::StatusCode::kPermissionDenied)
      << victim->connected->status();
  EXPECT_THAT(victim->connected->status().message(), HasSubstr("shared secret mismatch"));
  EXPECT_TRUE(victim->engine().Peers().empty());
  EXPECT_EQ(victim->engine().Stats().control.session_tokens, 0u);

  // The victim still serves a legitimate peer byte-exact (it listens too).
  victim->target->ExpectServesLegitimatePeer("s3cret");
}

// A relay that the victim was made to dial (e.g. a forged remote_host) plays the victim's own
// Hello back to the victim's listener and shuttles the proofs between the victim's two halves:
// without the secret, it would end up holding the listener's live token (reflection). The
// listener refuses a Hello carrying a nonce this process issued.
TEST(HostileHandshakeTest, ReflectedHelloIsRefusedAndTheRelayGetsNoToken) {
  std::unique_ptr<DialingVictim> victim = DialingVictim::Start("victim", 23);
  ASSERT_NE(victim, nullptr);
  std::string stolen_token;
  absl::Status read = absl::UnknownError("no token to try");
  {
    auto from_victim = victim->hostile.Accept();
    ASSERT_TRUE(from_victim.ok()) << from_victim.status();
    absl::StatusOr<pb::Envelope> hello = from_victim->Read();
    ASSERT_TRUE(hello.ok() && hello->has_hello()) << hello.status();
    auto to_victim = RawSocket::Dial(victim->engine().address());
    ASSERT_TRUE(to_victim.ok()) << to_victim.status();
    ASSERT_TRUE(to_victim->Send(*hello));  // the victim's own Hello, played back
    absl::StatusOr<pb::Envelope> ack = to_victim->Read();
    ASSERT_TRUE(ack.ok()) << ack.status();
    if (ack->has_hello_ack()) {
      // Unfixed: shuttle the proofs between the victim's halves and take the Welcome.
      const pb::Hello listener_hello = ack->hello_ack().hello();
      ASSERT_TRUE(from_victim->Send(*ack));
      absl::StatusOr<pb::Envelope> proof = from_victim->Read();
      if (proof.ok() && to_victim->Send(*proof)) {
        absl::StatusOr<pb::Envelope> welcome = to_victim->Read();
        if (welcome.ok() && welcome->has_welcome()) {
          stolen_token = welcome->welcome().session_token();
          std::vector<std::byte> stolen(kRegionBytes);
          read = ReadWithToken(TcpEndpointOf(listener_hello), stolen_token, victim->target->region,
                               kRegionBytes, stolen.data());
        }
      }
    } else {
      ASSERT_TRUE(ack->has_reject()) << control::MessageName(*ack);
      EXPECT_EQ(ack->reject().code(), static_cast<uint32_t>(absl::StatusCode::kPermissionDenied));
      EXPECT_THAT(ack->reject().reason(), HasSubstr("reflection"));
    }
  }  // the relay hangs up on both
  victim->Join();
  EXPECT_EQ(stolen_token, "") << "the relay holds a live token of the victim's listener";
  EXPECT_FALSE(read.ok()) << "the relay READ the victim's region without the secret";
  ASSERT_TRUE(victim->connected.has_value());
  EXPECT_FALSE(victim->connected->ok());
  EXPECT_TRUE(Eventually([&] { return victim->engine().Stats().control.session_tokens == 0; }));
  victim->target->ExpectServesLegitimatePeer("s3cret");
}

// A listener that knows the secret gets the dialer's token in AuthProof (the dialer verified
// its proof), opens a data connection with it, then Rejects the handshake. The dialer's
// Connect fails, so the connection must not outlive it: no peer was ever published.
TEST(HostileHandshakeTest, RejectedDialLeavesNoDataConnectionBehind) {
  std::unique_ptr<DialingVictim> victim = DialingVictim::Start("victim-dialer", 25);
  ASSERT_NE(victim, nullptr);
  std::unique_ptr<HeldDataConnection> held;
  absl::Status before_reject = absl::UnknownError("not tried");
  {
    auto socket = victim->hostile.Accept();
    ASSERT_TRUE(socket.ok()) << socket.status();
    absl::StatusOr<pb::Envelope> hello = socket->Read();
    ASSERT_TRUE(hello.ok() && hello->has_hello()) << hello.status();
    pb::Envelope ack;
    *ack.mutable_hello_ack()->mutable_hello() = ForgedHello("hostile-listener", true).hello();
    const std::string listener_nonce = ack.hello_ack().hello().auth_nonce();
    ack.mutable_hello_ack()->set_auth_proof(
        control::ListenerProof("s3cret", hello->hello().auth_nonce(), listener_nonce));
    ASSERT_TRUE(socket->Send(ack));
    absl::StatusOr<pb::Envelope> proof = socket->Read();
    ASSERT_TRUE(proof.ok() && proof->has_auth_proof()) << proof.status();
    const std::string token = proof->auth_proof().session_token();
    ASSERT_FALSE(token.empty());
    held = std::make_unique<HeldDataConnection>(TcpEndpointOf(hello->hello()), token);
    std::vector<std::byte> scratch(4096);
    before_reject = held->Read(victim->target->region, scratch.size(), scratch.data());
    pb::Envelope reject = control::MakeReject(absl::PermissionDeniedError("changed my mind"));
    EXPECT_TRUE(socket->Send(reject));
    EXPECT_TRUE(socket->WaitForEof(kWait));
  }
  victim->Join();
  ASSERT_TRUE(victim->connected.has_value());
  EXPECT_FALSE(victim->connected->ok());
  EXPECT_TRUE(victim->engine().Peers().empty());
  EXPECT_EQ(victim->engine().Stats().control.session_tokens, 0u);
  // The dialer's token was live while its handshake ran (the listener had proven the secret):
  // a READ then is what a deployment peer may do. After the Reject it must not be.
  EXPECT_TRUE(before_reject.ok()) << before_reject;
  std::vector<std::byte> stolen(kRegionBytes);
  bool still_served = true;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (still_served && absl::Now() < deadline) {
    still_served = held->Read(victim->target->region, kRegionBytes, stolen.data()).ok();
    if (still_served) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_FALSE(still_served)
      << "a data connection opened with the token of a rejected dial still reads the region";
  held.reset();
  victim->target->ExpectServesLegitimatePeer("s3cret");
}

TEST(HostileHandshakeTest, AbandonedAndFailedHandshakesLeaveNoTokenPendingEntryOrThread) {
  std::unique_ptr<Target> target = Target::Start(ShortDeadlines("s3cret"), 31);
  ASSERT_NE(target, nullptr);
  const int threads_before = ThreadCount();
  const std::string address = target->engine->address();
  {
    // Connects and never speaks.
    auto silent = RawSocket::Dial(address);
    ASSERT_TRUE(silent.ok());
    // Hello, then hangs up.
    auto quitter = RawSocket::Dial(address);
    ASSERT_TRUE(quitter.ok());
    ASSERT_TRUE(quitter->Send(ForgedHello("quitter", true)));
    ASSERT_TRUE(quitter->Read().ok());
    quitter->Close();
    // Hello, then never proves.
    auto stalled = RawSocket::Dial(address);
    ASSERT_TRUE(stalled.ok());
    ASSERT_TRUE(stalled->Send(ForgedHello("stalled", true)));
    ASSERT_TRUE(stalled->Read().ok());
    // A proof that is wrong.
    auto liar = RawSocket::Dial(address);
    ASSERT_TRUE(liar.ok());
    ASSERT_TRUE(liar->Send(ForgedHello("liar", true)));
    ASSERT_TRUE(liar->Read().ok());
    pb::Envelope proof;
    proof.mutable_auth_proof()->set_proof(std::string(32, 'p'));
    proof.mutable_auth_proof()->set_session_token("liar-token");
    ASSERT_TRUE(liar->Send(proof));
    absl::StatusOr<pb::Envelope> reject = liar->Read();
    ASSERT_TRUE(reject.ok()) << reject.status();
    ASSERT_TRUE(reject->has_reject());
    EXPECT_THAT(reject->reject().reason(), HasSubstr("shared secret mismatch"));

    // While they are pending, nothing is live for them.
    EXPECT_EQ(target->control().session_tokens, 0u);
    // All four end by the absolute deadline (1 s), whatever each did.
    ASSERT_TRUE(Eventually([&] {
      const ControlStats c = target->control();
      return c.handshakes_in_flight == 0 && c.control_connections == 0;
    })) << target->engine->Stats().ToJson();
    EXPECT_TRUE(silent->WaitForEof(kWait));
    EXPECT_TRUE(stalled->WaitForEof(kWait));
  }
  const ControlStats after = target->control();
  EXPECT_EQ(after.session_tokens, 0u);
  EXPECT_EQ(after.handshakes_failed, 4u);
  EXPECT_TRUE(target->engine->Peers().empty());
  EXPECT_EQ(ThreadCount(), threads_before);

  target->ExpectServesLegitimatePeer("s3cret");
  // The legitimate peer has gone again, and its token with it.
  EXPECT_TRUE(Eventually([&] { return target->control().session_tokens == 0; }));
}

// Wrong secret on either side of a handshake between two real engines: each Connect fails
// naming the mismatch, and neither engine keeps a token, a pending handshake or a peer.
TEST(HostileHandshakeTest, WrongSecretEitherWayFailsCleanlyOnBothEngines) {
  std::unique_ptr<Target> right = Target::Start(ShortDeadlines("right"), 41);
  std::unique_ptr<Target> wrong = Target::Start(ShortDeadlines("wrong"), 42);
  ASSERT_TRUE(right && wrong);
  // The dialer is wrong...
  auto dialed = wrong->engine->Connect(right->engine->address());
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kPermissionDenied) << dialed.status();
  EXPECT_THAT(dialed.status().message(), HasSubstr("shared secret mismatch"));
  // ...and the listener is wrong.
  dialed = right->engine->Connect(wrong->engine->address());
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kPermissionDenied) << dialed.status();
  EXPECT_THAT(dialed.status().message(), HasSubstr("shared secret mismatch"));

  for (const Target* t : {right.get(), wrong.get()}) {
    ASSERT_TRUE(Eventually([&] {
      const ControlStats c = t->control();
      return c.handshakes_in_flight == 0 && c.control_connections == 0;
    }));
    const ControlStats c = t->control();
    EXPECT_EQ(c.session_tokens, 0u);
    EXPECT_EQ(c.handshakes_failed, 1u);
    EXPECT_TRUE(t->engine->Peers().empty());
  }
  right->ExpectServesLegitimatePeer("right");
  wrong->ExpectServesLegitimatePeer("wrong");
}

// --- slow loris -------------------------------------------------------------------------

// Sends `bytes` one at a time every `interval` until the target closes the connection (or the
// bytes run out); returns how long it took from the first byte to the close, or nullopt.
std::optional<absl::Duration> TrickleUntilClosed(RawSocket& socket, const std::string& bytes,
                                                 absl::Duration interval, absl::Time start) {
  for (char c : bytes) {
    if (!socket.Write(std::string(1, c))) return absl::Now() - start;
    pollfd p{socket.fd(), POLLIN, 0};
    const absl::Time until = absl::Now() + interval;
    while (absl::Now() < until) {
      if (::poll(&p, 1, 10) > 0) {
        char buffer[4096];
        if (::recv(socket.fd(), buffer, sizeof(buffer), 0) <= 0) return absl::Now() - start;
      }
    }
  }
  return std::nullopt;
}

TEST(HostileHandshakeTest, SlowLorisIsDroppedAtTheAbsoluteDeadlineInEveryStage) {
  std::unique_ptr<Target> target = Target::Start(ShortDeadlines("s3cret"), 51);
  ASSERT_NE(target, nullptr);
  // One byte every 100 ms: a per-read timeout of 1 s would never fire. 100 bytes would take
  // 10 s; the handshake deadline is 1 s from accept.
  const std::string hello_frame = *control::EncodeFrame(ForgedHello("loris", true), 1 << 20);
  std::string long_frame = std::string("\0\0\x04\0", 4) + std::string(1020, 'x');
  {
    // Stage 1: trickling the Hello.
    auto loris = RawSocket::Dial(target->engine->address());
    ASSERT_TRUE(loris.ok());
    const absl::Time start = absl::Now();
    std::optional<absl::Duration> dropped =
        TrickleUntilClosed(*loris, long_frame.substr(0, 100), absl::Milliseconds(100), start);
    ASSERT_TRUE(dropped.has_value()) << "a dialer trickling its Hello was never dropped";
    EXPECT_GE(*dropped, absl::Milliseconds(900));
    EXPECT_LE(*dropped, absl::Seconds(5));
  }
  {
    // Stage 2: a prompt Hello, then trickling the AuthProof; the deadline still counts from
    // the accept.
    auto loris = RawSocket::Dial(target->engine->address());
    ASSERT_TRUE(loris.ok());
    const absl::Time start = absl::Now();
    ASSERT_TRUE(loris->Send(ForgedHello("loris", true)));
    ASSERT_TRUE(loris->Read().ok());
    std::optional<absl::Duration> dropped =
        TrickleUntilClosed(*loris, long_frame.substr(0, 100), absl::Milliseconds(100), start);
    ASSERT_TRUE(dropped.has_value()) << "a dialer trickling its AuthProof was never dropped";
    EXPECT_GE(*dropped, absl::Milliseconds(900));
    EXPECT_LE(*dropped, absl::Seconds(5));
  }
  ASSERT_TRUE(Eventually([&] { return target->control().handshakes_in_flight == 0; }));
  EXPECT_EQ(target->control().handshakes_failed, 2u);
  EXPECT_EQ(target->control().session_tokens, 0u);
  target->ExpectServesLegitimatePeer("s3cret");
}

// A Hello frame announced larger than any Hello is refused at its header, before the listener
// buffers it: an unauthenticated dialer cannot make it hold max_frame_bytes.
TEST(HostileHandshakeTest, OversizedHandshakeFrameIsRefusedAtItsHeader) {
  std::unique_ptr<Target> target = Target::Start(ShortDeadlines("s3cret"), 52);
  ASSERT_NE(target, nullptr);
  auto big = RawSocket::Dial(target->engine->address());
  ASSERT_TRUE(big.ok());
  const uint32_t announced = 1 << 20;  // under max_frame_bytes (16 MiB), over the handshake's
  ASSERT_TRUE(
      big->Write(std::string{static_cast<char>(announced >> 24), static_cast<char>(announced >> 16),
                             static_cast<char>(announced >> 8), static_cast<char>(announced)}));
  absl::StatusOr<pb::Envelope> reject = big->Read();
  ASSERT_TRUE(reject.ok()) << reject.status();
  ASSERT_TRUE(reject->has_reject());
  EXPECT_THAT(reject->reject().reason(), HasSubstr("above the limit of 65536 bytes"));
  EXPECT_TRUE(big->WaitForEof(kWait));
  target->ExpectServesLegitimatePeer("s3cret");
}

// --- floods -----------------------------------------------------------------------------

TEST(HostileHandshakeTest, HandshakeFloodBeyondTheCapIsRefusedThenALegitimatePeerIsServed) {
  EngineOptions options = ShortDeadlines("s3cret");
  options.connect_timeout = absl::Seconds(3);
  options.max_pending_handshakes = 4;
  std::unique_ptr<Target> target = Target::Start(options, 61);
  ASSERT_NE(target, nullptr);
  std::vector<RawSocket> flood;
  for (int i = 0; i < 4; ++i) {
    auto s = RawSocket::Dial(target->engine->address());
    ASSERT_TRUE(s.ok());
    flood.push_back(*std::move(s));
  }
  ASSERT_TRUE(Eventually([&] { return target->control().handshakes_in_flight == 4; }));

  // The fifth dialer is told why.
  auto fifth = RawSocket::Dial(target->engine->address());
  ASSERT_TRUE(fifth.ok());
  absl::StatusOr<pb::Envelope> reject = fifth->Read();
  ASSERT_TRUE(reject.ok()) << reject.status();
  ASSERT_TRUE(reject->has_reject());
  EXPECT_EQ(reject->reject().code(), static_cast<uint32_t>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(reject->reject().reason(),
              HasSubstr("too many control handshakes in flight (limit 4)"));
  EXPECT_TRUE(fifth->WaitForEof(kWait));
  // So is a real engine, through Connect.
  {
    EngineOptions dialer_options;
    dialer_options.shared_secret = "s3cret";
    auto dialer = Engine::Create(dialer_options);
    ASSERT_TRUE(dialer.ok());
    auto refused = (*dialer)->Connect(target->engine->address());
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_THAT(refused.status().message(),
                HasSubstr("too many control handshakes in flight (limit 4)"));
  }
  EXPECT_EQ(target->control().handshakes_refused, 2u);
  EXPECT_EQ(target->control().session_tokens, 0u);

  flood.clear();
  ASSERT_TRUE(Eventually([&] { return target->control().handshakes_in_flight == 0; }));
  target->ExpectServesLegitimatePeer("s3cret");
}

// One host (127.0.0.2) holding handshakes open cannot take every unauthenticated slot: past
// its per-source share it is refused, and a dialer from elsewhere is served meanwhile.
TEST(HostileHandshakeTest, OneSourceCannotTakeEveryHandshakeSlot) {
  EngineOptions options = ShortDeadlines("s3cret");
  options.connect_timeout = absl::Seconds(5);
  options.max_pending_handshakes = 8;
  options.max_pending_handshakes_per_source = 3;
  std::unique_ptr<Target> target = Target::Start(options, 63);
  ASSERT_NE(target, nullptr);
  std::vector<RawSocket> flood;
  for (int i = 0; i < 3; ++i) {
    auto s = RawSocket::Dial(target->engine->address(), "127.0.0.2");
    ASSERT_TRUE(s.ok()) << s.status();
    flood.push_back(*std::move(s));
  }
  ASSERT_TRUE(Eventually([&] { return target->control().handshakes_in_flight == 3; }));
  for (int i = 0; i < 5; ++i) {
    auto more = RawSocket::Dial(target->engine->address(), "127.0.0.2");
    ASSERT_TRUE(more.ok()) << more.status();
    absl::StatusOr<pb::Envelope> reject = more->Read();
    ASSERT_TRUE(reject.ok()) << reject.status();
    ASSERT_TRUE(reject->has_reject());
    EXPECT_EQ(reject->reject().code(), static_cast<uint32_t>(absl::StatusCode::kResourceExhausted));
    EXPECT_THAT(reject->reject().reason(),
                HasSubstr("too many control handshakes in flight from 127.0.0.2 (limit 3)"));
  }
  EXPECT_EQ(target->control().handshakes_in_flight, 3u);
  // While the flood is held, a peer from 127.0.0.1 completes its handshake and reads exactly.
  target->ExpectServesLegitimatePeer("s3cret");
  flood.clear();
  ASSERT_TRUE(Eventually([&] { return target->control().handshakes_in_flight == 0; }));
}

TEST(HostileHandshakeTest, ControlConnectionsBeyondTheCapAreRefusedUntilOneCloses) {
  EngineOptions options = ShortDeadlines("s3cret");
  options.connect_timeout = absl::Seconds(5);
  options.max_control_connections = 2;
  std::unique_ptr<Target> target = Target::Start(options, 62);
  ASSERT_NE(target, nullptr);
  EngineOptions dialer_options;
  dialer_options.shared_secret = "s3cret";
  dialer_options.transport = "tcp";
  std::vector<std::unique_ptr<Engine>> dialers;
  for (int i = 0; i < 2; ++i) {
    auto dialer = Engine::Create(dialer_options);
    ASSERT_TRUE(dialer.ok());
    ASSERT_TRUE((*dialer)->Connect(target->engine->address()).ok());
    dialers.push_back(*std::move(dialer));
  }
  EXPECT_EQ(target->control().control_connections, 2u);
  auto third = Engine::Create(dialer_options);
  ASSERT_TRUE(third.ok());
  auto refused = (*third)->Connect(target->engine->address());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("too many control connections (limit 2)"));

  dialers.pop_back();  // one peer leaves; its connection closes on the target too
  ASSERT_TRUE(Eventually([&] { return target->control().control_connections == 1; }));
  target->ExpectServesLegitimatePeer("s3cret");
}

// --- a token source that fails ----------------------------------------------------------

int FailingRandBytes(unsigned char*, int) { return 0; }
int FailingRandStatus() { return 0; }

// While installed, OpenSSL's RAND_bytes fails in this process.
class FailingCsprng {
 public:
  FailingCsprng() : saved_(RAND_get_rand_method()) {
    method_.bytes = FailingRandBytes;
    method_.status = FailingRandStatus;
    RAND_set_rand_method(&method_);
  }
  ~FailingCsprng() { RAND_set_rand_method(saved_); }

 private:
  const RAND_METHOD* saved_;
  RAND_METHOD method_{};
};

TEST(HostileHandshakeTest, WithoutACsprngTheEngineRefusesToStartAndIssuesNoToken) {
  std::unique_ptr<Target> target = Target::Start(ShortDeadlines(""), 71);
  ASSERT_NE(target, nullptr);
  {
    FailingCsprng failing;
    auto engine = Engine::Create(EngineOptions());
    ASSERT_FALSE(engine.ok());
    EXPECT_THAT(engine.status().message(), HasSubstr("CSPRNG"));
    // A dialer (no secret) reaches the point where the listener would issue its token.
    auto raw = RawSocket::Dial(target->engine->address());
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw->Send(ForgedHello("early", /*with_secret=*/false)));
    absl::StatusOr<pb::Envelope> reject = raw->Read();
    ASSERT_TRUE(reject.ok()) << reject.status();
    ASSERT_TRUE(reject->has_reject()) << reject->DebugString();
    EXPECT_THAT(reject->reject().reason(), HasSubstr("cannot issue a session token"));
    EXPECT_THAT(reject->reject().reason(), HasSubstr("CSPRNG"));
  }
  EXPECT_EQ(target->control().session_tokens, 0u);
  target->ExpectServesLegitimatePeer("");
}

// --- after the handshake: unknown or malformed messages ------------------------------------

// A hostile engine that completed a real handshake (it knows the secret) and then sends raw
// envelopes on its control connection. It offers a tcp data port, so the target's data path
// to it comes up like to any peer.
struct HandshakenHostile {
  // Serves the target's data connections (accepts any token) but exports nothing.
  FakeTargetHooks hooks{AnyToken(1)};
  std::unique_ptr<transport::Transport> tcp;
  boost::asio::io_context io;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work{
      io.get_executor()};
  std::thread thread{[this] { io.run(); }};
  std::shared_ptr<control::Connection> conn;
  pb::Hello remote_hello;
  Mutex mu;
  CondVar cv;
  std::optional<absl::Status> closed ABSL_GUARDED_BY(mu);

  ~HandshakenHostile() {
    if (conn) conn->Close(absl::CancelledError("test over"));
    work.reset();
    io.stop();
    thread.join();
    if (tcp) tcp->Shutdown();
  }
  absl::Status Connect(const std::string& address, const std::string& secret) {
    auto t = transport::CreateTcpTransport(transport::TcpTransportOptions(), &hooks);
    if (!t.ok()) return t.status();
    tcp = *std::move(t);
    control::HandshakeConfig config;
    config.compat_hash = control::CompatibilityHash(0);
    config.shared_secret = secret;
    pb::Hello hello = ForgedHello("hostile", !secret.empty()).hello();
    pb::TransportEndpoint* ep = hello.add_transports();
    ep->set_kind("tcp");
    ep->set_endpoint(tcp->Endpoint());
    auto accepted = control::Dial(io, address, hello, config);
    if (!accepted.ok()) return accepted.status();
    remote_hello = accepted->remote_hello;
    conn = accepted->connection;
    conn->Start([](const pb::Envelope&) {},
                [this](const absl::Status& s) {
                  MutexLock lock(&mu);
                  closed = s;
                  cv.SignalAll();
                },
                absl::Milliseconds(200), absl::Seconds(30));
    return absl::OkStatus();
  }
  absl::Status WaitClosed() {
    const absl::Time deadline = absl::Now() + kWait;
    MutexLock lock(&mu);
    while (!closed.has_value() && absl::Now() < deadline) cv.WaitUntil(&mu, deadline);
    return closed.value_or(absl::DeadlineExceededError("the target never closed the peer"));
  }
};

struct BadMessage {
  const char* name;
  pb::Envelope (*make)();
  const char* expect_in_goodbye;
  bool counted;  // in ControlStats::peers_closed_for_protocol (the engine's checks)
  bool needs_no_rdma = false;
};
void PrintTo(const BadMessage& m, std::ostream* os) { *os << m.name; }

class BadControlMessageTest : public ::testing::TestWithParam<BadMessage> {};

TEST_P(BadControlMessageTest, ClosesOnlyThatPeerWithTheReasonInItsGoodbye) {
  std::unique_ptr<Target> target = Target::Start(ShortDeadlines("s3cret"), 81);
  ASSERT_NE(target, nullptr);
  HandshakenHostile hostile;
  ASSERT_TRUE(hostile.Connect(target->engine->address(), "s3cret").ok());
  // A peer in good standing first (its data path is up), so the close is the message's doing.
  ASSERT_TRUE(target->engine->WaitForPeer("hostile", kWait).ok());
  if (GetParam().needs_no_rdma && !TransportEndpointOf(hostile.remote_hello, "rdma").empty()) {
    GTEST_SKIP() << "the target has an rdma device, so rdma messages are expected from peers";
  }
  const uint64_t closed_before = target->control().peers_closed_for_protocol;
  ASSERT_TRUE(hostile.conn->Send(GetParam().make()).ok());
  absl::Status closed = hostile.WaitClosed();
  EXPECT_NE(closed.code(), absl::StatusCode::kDeadlineExceeded) << closed;
  // "peer closed: <the target's reason>": the Goodbye carried it.
  EXPECT_THAT(closed.message(), HasSubstr("peer closed: "));
  EXPECT_THAT(closed.message(), HasSubstr(GetParam().expect_in_goodbye));
  if (GetParam().counted) {
    EXPECT_EQ(target->control().peers_closed_for_protocol, closed_before + 1);
  }
  target->ExpectServesLegitimatePeer("s3cret");
}

INSTANTIATE_TEST_SUITE_P(
    Messages, BadControlMessageTest,
    ::testing::Values(BadMessage{"ExportRegionsWithUnknownMemoryKind",
                                 [] {
                                   pb::Envelope e;
                                   pb::RegionDescriptor* d =
                                       e.mutable_export_regions()->add_regions();
                                   d->set_id(5);
                                   d->set_length(4096);
                                   d->set_memory_kind(7);
                                   return e;
                                 },
                                 "memory_kind 7", true},
                      BadMessage{"HandshakeMessageAfterTheHandshake",
                                 [] {
                                   pb::Envelope e;
                                   e.mutable_welcome()->set_session_token("again");
                                   return e;
                                 },
                                 "unexpected Welcome after the handshake", false},
                      BadMessage{"HelloAfterTheHandshake",
                                 [] { return ForgedHello("again", true); },
                                 "unexpected Hello after the handshake", false},
                      BadMessage{"RdmaControlToAnEngineWithoutRdma",
                                 [] {
                                   pb::Envelope e;
                                   e.mutable_transport_control()->set_transport("rdma");
                                   return e;
                                 },
                                 "offers no rdma", true, /*needs_no_rdma=*/true},
                      BadMessage{"ControlForATransportNoEngineHas",
                                 [] {
                                   pb::Envelope e;
                                   e.mutable_transport_control()->set_transport("carrier-pigeon");
                                   e.mutable_transport_control()->set_payload("coo");
                                   return e;
                                 },
                                 "offers no carrier-pigeon", true}),
    [](const ::testing::TestParamInfo<BadMessage>& info) { return info.param.name; });

// --- what a peer can make the engine hold --------------------------------------------------

TEST(HostileHandshakeTest, ClosedPeersAreReclaimed) {
  EngineOptions options = ShortDeadlines("");
  options.connect_timeout = absl::Seconds(5);
  options.closed_peers_kept = 2;
  std::unique_ptr<Target> target = Target::Start(options, 91);
  ASSERT_NE(target, nullptr);
  EngineOptions dialer_options;
  dialer_options.transport = "tcp";
  for (int i = 0; i < 6; ++i) {
    auto dialer = Engine::Create(dialer_options);
    ASSERT_TRUE(dialer.ok());
    ASSERT_TRUE((*dialer)->Connect(target->engine->address()).ok());
  }  // each dialer leaves again
  // Six peers came and went; the target settles with at most two of them listed.
  EXPECT_TRUE(Eventually([&] {
    std::vector<PeerInfo> peers = target->engine->Peers();
    for (const PeerInfo& p : peers) {
      if (p.alive) return false;
    }
    return peers.size() <= 2 && target->control().session_tokens == 0;
  })) << target->engine->Stats().ToJson();
  EXPECT_LE(target->engine->Stats().peers.size(), 2u);
  target->ExpectServesLegitimatePeer("");
}

TEST(HostileHandshakeTest, UndrainedNotificationsAreBoundedAndCounted) {
  EngineOptions options = ShortDeadlines("");
  options.connect_timeout = absl::Seconds(5);
  options.max_undrained_notifications = 3;
  std::unique_ptr<Target> target = Target::Start(options, 92);
  ASSERT_NE(target, nullptr);
  EngineOptions sender_options;
  sender_options.transport = "tcp";
  auto sender = Engine::Create(sender_options);
  ASSERT_TRUE(sender.ok());
  std::vector<std::byte> buf(4096, std::byte{7});
  auto local = (*sender)->RegisterMemory(buf.data(), buf.size());
  ASSERT_TRUE(local.ok());
  auto peer = (*sender)->Connect(target->engine->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE((*sender)->WaitForRemoteRegion(*peer, target->region, kWait).ok());
  auto send = [&](int i) {
    TransferOptions t;
    t.notification = absl::StrCat("n", i);
    auto id = (*sender)->Transfer(*peer, OpKind::kWrite, {Op{*local, 0, target->region, 0, 64}}, t);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE((*sender)->Wait(*id, kWait).ok());
    // The notification travels on the control connection, the data on tcp data connections:
    // settle each one (delivered or dropped) before the next transfer, so that the entries
    // waiting for their notification never exceed the bound this test sets.
    ASSERT_TRUE(Eventually([&] {
      const EngineStats stats = target->engine->Stats();
      return stats.notifications_delivered + stats.control.notifications_dropped ==
             static_cast<uint64_t>(i) + 1;
    })) << target->engine->Stats().ToJson();
  };
  for (int i = 0; i < 5; ++i) send(i);
  ASSERT_TRUE(Eventually([&] { return target->control().notifications_dropped == 2; }))
      << target->engine->Stats().ToJson();
  std::vector<Notification> taken = target->engine->TakeNotifications();
  ASSERT_EQ(taken.size(), 3u);
  EXPECT_EQ(taken[0].payload, "n0");
  EXPECT_EQ(taken[2].payload, "n2");
  // Drained: the next one is delivered, and the sender was never dropped for it.
  send(5);
  auto next = target->engine->WaitNotification(kWait);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->payload, "n5");
  EXPECT_EQ(target->control().notifications_dropped, 2u);
  bool sender_alive = false;
  for (const PeerInfo& p : target->engine->Peers()) {
    sender_alive |= p.name == (*sender)->name() && p.alive;
  }
  EXPECT_TRUE(sender_alive) << "the sender was closed for notifications the consumer left";
}

}  // namespace
}  // namespace kvwire::testing
