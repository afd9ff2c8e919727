// The tcp data port as an attacker sees it, against a real engine in its own process
// (hostile_tcp_target, with short limits): a connection flood, a hello that trickles in, a
// peer with a valid token that opens too many connections, and an authenticated peer that
// stalls in the middle of a WRITE or a READ while the target holds its region pinned. Each is
// refused or cut with a clear error, within a bounded time, leaving nothing pinned; after it a
// well-behaved engine still moves bytes exactly.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <poll.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "src/control/control.h"
#include "src/util/mutex.h"
#include "tests/integration/peer_process.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/fake_target_hooks.h"
#include "tests/support/tcp_backend.h"
#include "transport/tcp/tcp_io_pool.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/tcp/tcp_wire.h"

namespace kvwire::testing {
namespace {

namespace wire = transport::tcp_wire;
using ::testing::HasSubstr;
using ::testing::StartsWith;

const ::testing::Environment* const kBackendEnvironment = ::testing::AddGlobalTestEnvironment(
    new kvwire::testing::TcpBackendEnvironment);  // NOLINT: gtest owns it

constexpr uint64_t kRegionBytes = 1 << 20;
constexpr uint64_t kSeed = 5;
constexpr char kSecret[] = "hostile-tcp-secret";

std::vector<std::string> TargetArgs(const std::vector<std::string>& limits) {
  std::vector<std::string> args = {"--regions=3", absl::StrCat("--region_bytes=", kRegionBytes),
                                   absl::StrCat("--seed=", kSeed),
                                   absl::StrCat("--secret=", kSecret)};
  args.insert(args.end(), limits.begin(), limits.end());
  return args;
}

// One field of the target's tcp_listener stats (STATS command), or -1.
int64_t ListenerStat(PeerProcess& target, const std::string& field) {
  if (!target.WriteLine("STATS").ok()) return -1;
  absl::StatusOr<std::string> line = target.ReadLine(absl::Seconds(10));
  if (!line.ok()) return -1;
  const size_t section = line->find("\"tcp_listener\":{");
  if (section == std::string::npos) return -1;
  const std::string key = absl::StrCat("\"", field, "\":");
  const size_t at = line->find(key, section);
  if (at == std::string::npos) return -1;
  const size_t begin = at + key.size();
  const size_t end = line->find_first_not_of("0123456789", begin);
  int64_t value = -1;
  if (!absl::SimpleAtoi(line->substr(begin, end - begin), &value)) return -1;
  return value;
}

// Deregisters `region` in the target: "ok <ms>" or "error <ms> <message>".
std::string Deregister(PeerProcess& target, RegionId region) {
  if (absl::Status s = target.WriteLine(absl::StrCat("DEREGISTER ", region)); !s.ok()) {
    return s.ToString();
  }
  // Longer than the 10 s DeregisterMemory itself waits for pins.
  absl::StatusOr<std::string> line = target.ReadLine(absl::Seconds(20));
  if (!line.ok()) return line.status().ToString();
  return line->substr(std::min(line->size(), sizeof("DEREGISTER")));
}

// A raw data connection, opened the way a hostile dialer would.
class RawConn {
 public:
  // `source`: local address to bind (any 127.0.0.0/8 address reaches the loopback target).
  // `rcvbuf` > 0: a small receive buffer, so that the target's sends back up quickly.
  static absl::StatusOr<std::unique_ptr<RawConn>> Open(const std::string& endpoint,
                                                       const std::string& source = "",
                                                       int rcvbuf = 0) {
    std::string host;
    uint16_t port = 0;
    if (absl::Status s = transport::ParseEndpoint(endpoint, &host, &port); !s.ok()) return s;
    auto c = std::make_unique<RawConn>(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (c->fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
    if (rcvbuf > 0) ::setsockopt(c->fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    if (!source.empty()) {
      sockaddr_in local{};
      local.sin_family = AF_INET;
      ::inet_pton(AF_INET, source.c_str(), &local.sin_addr);
      if (::bind(c->fd_, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0) {
        return absl::InternalError(absl::StrCat("bind ", source, ": ", std::strerror(errno)));
      }
    }
    sockaddr_in remote{};
    remote.sin_family = AF_INET;
    remote.sin_port = htons(port);
    ::inet_pton(AF_INET, host.c_str(), &remote.sin_addr);
    if (::connect(c->fd_, reinterpret_cast<sockaddr*>(&remote), sizeof(remote)) != 0) {
      return absl::UnavailableError(absl::StrCat("connect ", endpoint, ": ", std::strerror(errno)));
    }
    return c;
  }

  explicit RawConn(int fd) : fd_(fd) {}
  ~RawConn() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawConn(const RawConn&) = delete;
  RawConn& operator=(const RawConn&) = delete;

  absl::Status Send(const void* data, size_t length) {
    return transport::SendAll(fd_, data, length);
  }

  absl::Status SendHello(const std::string& token) {
    std::array<std::byte, wire::kHelloBytes> header;
    wire::Hello hello;
    hello.token_len = static_cast<uint32_t>(token.size());
    wire::EncodeHello(hello, header.data());
    if (absl::Status s = Send(header.data(), header.size()); !s.ok()) return s;
    return Send(token.data(), token.size());
  }

  // The target's hello reply as a status (OK: accepted).
  absl::StatusOr<absl::Status> ReadHelloReply(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    std::array<std::byte, wire::kHelloReplyBytes> raw;
    if (absl::Status s = RecvExact(raw.data(), raw.size(), deadline); !s.ok()) return s;
    wire::HelloReply reply;
    if (absl::Status s = wire::DecodeHelloReply(raw.data(), &reply); !s.ok()) return s;
    std::string message(reply.message_len, '\0');
    if (absl::Status s = RecvExact(message.data(), message.size(), deadline); !s.ok()) return s;
    return absl::Status(wire::CodeFromWire(reply.code), message);
  }

  // Whether anything (bytes, end of stream, reset) arrives within `timeout`.
  bool Readable(absl::Duration timeout) {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) > 0;
  }

  // True when the target closed the connection (end of stream or reset) within `timeout`;
  // whatever it sent before is skipped.
  bool WaitClosed(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    std::vector<char> sink(1 << 20);
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration() || !Readable(left)) return false;
      const ssize_t n = ::recv(fd_, sink.data(), sink.size(), MSG_DONTWAIT);
      if (n == 0) return true;
      if (n < 0 && errno != EAGAIN && errno != EINTR) return true;
    }
  }

 private:
  absl::Status RecvExact(void* data, size_t length, absl::Time deadline) {
    auto* p = static_cast<char*>(data);
    while (length > 0) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration() || !Readable(left)) {
        return absl::DeadlineExceededError("no reply from the target");
      }
      const ssize_t n = ::recv(fd_, p, length, MSG_DONTWAIT);
      if (n == 0) return absl::UnavailableError("the target closed the connection");
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        return absl::UnavailableError(std::strerror(errno));
      }
      p += n;
      length -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  int fd_ = -1;
};

// The legitimate way to a session token: a real control handshake with the right secret.
// What the test then does with the token is up to it (raw data connections).
class Dialer {
 public:
  ~Dialer() {
    if (conn_) conn_->Close(absl::CancelledError("test over"));
    if (tcp_) tcp_->Shutdown();
    work_.reset();
    io_.stop();
    if (io_thread_.joinable()) io_thread_.join();
  }

  absl::Status Connect(const std::string& address) {
    work_ = std::make_unique<Work>(io_.get_executor());
    io_thread_ = std::thread([this] { io_.run(); });
    transport::TcpTransportOptions tcp_options;
    tcp_options.io_backend = kvwire::testing::TcpTestBackend();
    auto t = transport::CreateTcpTransport(tcp_options, &hooks_);
    if (!t.ok()) return t.status();
    tcp_ = std::move(*t);
    pb::Hello hello;
    hello.set_engine_name("hostile-tcp");
    hello.set_pid(static_cast<uint32_t>(getpid()));
    hello.set_session_token("hostile-tcp-token");
    hello.set_transport_preference("tcp");
    pb::TransportEndpoint* ep = hello.add_transports();
    ep->set_kind("tcp");
    ep->set_endpoint(tcp_->Endpoint());
    control::HandshakeConfig config;
    config.compat_hash = control::CompatibilityHash(0);
    config.shared_secret = kSecret;
    auto accepted = control::Dial(io_, address, hello, config);
    if (!accepted.ok()) return accepted.status();
    conn_ = accepted->connection;
    conn_->Start([](const pb::Envelope&) {},
                 [this](const absl::Status& s) {
                   MutexLock lock(&mu_);
                   closed_ = true;
                   close_status_ = s;
                   cv_.SignalAll();
                 },
                 absl::Milliseconds(200), absl::Seconds(30));
    token_ = accepted->remote_hello.session_token();
    for (const auto& t : accepted->remote_hello.transports()) {
      if (t.kind() == "tcp") data_endpoint_ = t.endpoint();
    }
    if (data_endpoint_.empty()) return absl::NotFoundError("the target offers no tcp endpoint");
    return absl::OkStatus();
  }

  const std::string& token() const { return token_; }
  const std::string& data_endpoint() const { return data_endpoint_; }

  // Why the target closed the control connection; DeadlineExceeded if it did not.
  absl::StatusOr<absl::Status> WaitClosed(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    MutexLock lock(&mu_);
    while (!closed_ && absl::Now() < deadline) cv_.WaitUntil(&mu_, deadline);
    if (!closed_) return absl::DeadlineExceededError("the target kept the hostile peer");
    return close_status_;
  }

 private:
  using Work = boost::asio::executor_work_guard<boost::asio::io_context::executor_type>;
  boost::asio::io_context io_;
  std::unique_ptr<Work> work_;
  std::thread io_thread_;
  // Serves nothing: the target dials this side back for its own channel, and is let in.
  FakeTargetHooks hooks_{AnyToken(1)};
  std::unique_ptr<transport::Transport> tcp_;
  std::shared_ptr<control::Connection> conn_;
  std::string token_;
  std::string data_endpoint_;
  Mutex mu_;
  CondVar cv_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status close_status_ ABSL_GUARDED_BY(mu_);
};

// A well-behaved engine that moves bytes over tcp and checks every one of them.
class GoodPeer {
 public:
  absl::Status Connect(const std::string& address) {
    EngineOptions options;
    options.name = "good-peer";
    options.shared_secret = kSecret;
    options.transport = "tcp";
    options.tcp().io_backend = kvwire::testing::TcpTestBackend();
    auto engine = Engine::Create(options);
    if (!engine.ok()) return engine.status();
    engine_ = std::move(*engine);
    local_.resize(2 * kRegionBytes);
    auto local = engine_->RegisterMemory(local_.data(), local_.size());
    if (!local.ok()) return local.status();
    local_region_ = *local;
    auto peer = engine_->Connect(address);
    if (!peer.ok()) return peer.status();
    peer_ = *peer;
    return absl::OkStatus();
  }

  // WRITEs fresh bytes to the first quarter of `remote`, READs them back, and READs the
  // untouched second half, which must still hold the target's pattern.
  absl::Status RoundTrip(RegionId remote, int region_index) {
    if (absl::Status s = engine_->WaitForRemoteRegion(peer_, remote, absl::Seconds(10)); !s.ok()) {
      return s;
    }
    constexpr uint64_t kQuarter = kRegionBytes / 4;
    constexpr uint64_t kHalf = kRegionBytes / 2;
    ++round_;
    for (uint64_t i = 0; i < kQuarter; ++i) local_[i] = PatternByte(1000 + round_, 7, i);
    const std::vector<std::pair<OpKind, Op>> steps = {
        {OpKind::kWrite, Op{local_region_, 0, remote, 0, kQuarter}},
        {OpKind::kRead, Op{local_region_, kRegionBytes, remote, 0, kQuarter}},
        {OpKind::kRead, Op{local_region_, kRegionBytes + kHalf, remote, kHalf, kHalf}},
    };
    for (const auto& [kind, op] : steps) {
      auto id = engine_->Transfer(peer_, kind, {op});
      if (!id.ok()) return id.status();
      if (absl::Status s = engine_->Wait(*id, absl::Seconds(30)); !s.ok()) return s;
    }
    for (uint64_t i = 0; i < kQuarter; ++i) {
      if (local_[kRegionBytes + i] != local_[i]) {
        return absl::DataLossError(absl::StrCat("byte ", i, " written then read differs"));
      }
    }
    for (uint64_t i = kHalf; i < kRegionBytes; ++i) {
      if (local_[kRegionBytes + i] != PatternByte(kSeed, region_index, i)) {
        return absl::DataLossError(absl::StrCat("byte ", i, " of the target's pattern differs"));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<Engine> engine_;
  std::vector<std::byte> local_;
  RegionId local_region_ = 0;
  PeerId peer_ = 0;
  int round_ = 0;
};

struct FloodOutcome {
  int held = 0;     // still open, nothing received
  int refused = 0;  // answered with the expected refusal
  std::vector<std::string> other;
};

// Opens `count` connections from `source` that never send a byte, and sorts them by what
// the target did within a second: refused (with `limit` named) or held.
FloodOutcome Flood(const std::string& endpoint, const std::string& source, int count,
                   const std::string& limit, std::vector<std::unique_ptr<RawConn>>* held) {
  FloodOutcome out;
  std::vector<std::unique_ptr<RawConn>> conns;
  for (int i = 0; i < count; ++i) {
    auto c = RawConn::Open(endpoint, source);
    if (!c.ok()) {
      out.other.push_back(c.status().ToString());
      continue;
    }
    conns.push_back(std::move(*c));
  }
  absl::SleepFor(absl::Seconds(1));
  for (std::unique_ptr<RawConn>& c : conns) {
    if (!c->Readable(absl::ZeroDuration())) {
      ++out.held;
      held->push_back(std::move(c));
      continue;
    }
    absl::StatusOr<absl::Status> reply = c->ReadHelloReply(absl::Seconds(5));
    if (reply.ok() && reply->code() == absl::StatusCode::kResourceExhausted &&
        absl::StrContains(reply->message(), limit)) {
      ++out.refused;
    } else {
      out.other.push_back(reply.ok() ? reply->ToString() : reply.status().ToString());
    }
  }
  return out;
}

TEST(HostileTcpTest, ConnectionFloodIsRefusedBeyondTheCapsAndHeldOnesEndAtTheHelloDeadline) {
  auto target = PeerProcess::Start(TargetArgs({"--max_connections=16", "--max_pending=64",
                                               "--max_pending_per_address=8", "--hello_ms=8000"}));
  ASSERT_TRUE(target.ok()) << target.status();
  Dialer probe;  // only to learn the data endpoint
  ASSERT_TRUE(probe.Connect((*target)->address()).ok());
  const std::string endpoint = probe.data_endpoint();

  // 20 silent connections from one address: 8 wait for their hello, 12 are refused.
  std::vector<std::unique_ptr<RawConn>> held;
  FloodOutcome first =
      Flood(endpoint, "127.0.0.2", 20, "tcp.max_pending_hellos_per_address", &held);
  EXPECT_EQ(first.held, 8);
  EXPECT_EQ(first.refused, 12);
  EXPECT_TRUE(first.other.empty()) << first.other.front();

  // A peer from another address is served meanwhile (4 data connections).
  GoodPeer good;
  ASSERT_TRUE(good.Connect((*target)->address()).ok());
  const RegionId r0 = (*target)->regions()[0];
  ASSERT_TRUE(good.RoundTrip(r0, 0).ok());

  // A second address finds the total limit: 8 + 4 open, 4 more fit under 16.
  FloodOutcome second = Flood(endpoint, "127.0.0.3", 20, "tcp.max_data_connections", &held);
  EXPECT_EQ(second.held, 4);
  EXPECT_EQ(second.refused, 16);
  EXPECT_TRUE(second.other.empty()) << second.other.front();
  EXPECT_EQ(ListenerStat(**target, "refused_over_limit"), 28);

  // Every held connection is cut at its absolute hello deadline.
  for (std::unique_ptr<RawConn>& c : held) EXPECT_TRUE(c->WaitClosed(absl::Seconds(15)));
  EXPECT_EQ(ListenerStat(**target, "hello_timeouts"), 12);
  EXPECT_EQ(ListenerStat(**target, "connections"), 4);
  EXPECT_TRUE(good.RoundTrip(r0, 0).ok());
  (*target)->Stop();
}

TEST(HostileTcpTest, TricklingHelloIsCutAtTheAbsoluteDeadline) {
  auto target = PeerProcess::Start(TargetArgs({"--hello_ms=1500"}));
  ASSERT_TRUE(target.ok()) << target.status();
  Dialer probe;
  ASSERT_TRUE(probe.Connect((*target)->address()).ok());
  auto conn = RawConn::Open(probe.data_endpoint());
  ASSERT_TRUE(conn.ok()) << conn.status();

  // A valid hello header announcing a 64-byte token, then one token byte every 250 ms: each
  // receive makes progress, but the stage never ends.
  std::array<std::byte, wire::kHelloBytes> header;
  wire::Hello hello;
  hello.token_len = 64;
  wire::EncodeHello(hello, header.data());
  ASSERT_TRUE((*conn)->Send(header.data(), header.size()).ok());
  const absl::Time start = absl::Now();
  bool closed = false;
  while (!closed && absl::Now() - start < absl::Seconds(10)) {
    const char byte = 'x';
    closed = !(*conn)->Send(&byte, 1).ok() || (*conn)->WaitClosed(absl::Milliseconds(250));
  }
  const absl::Duration held = absl::Now() - start;
  EXPECT_TRUE(closed) << "still open after " << held;
  EXPECT_LT(held, absl::Milliseconds(1500) + absl::Seconds(3));
  EXPECT_EQ(ListenerStat(**target, "hello_timeouts"), 1);

  GoodPeer good;
  ASSERT_TRUE(good.Connect((*target)->address()).ok());
  EXPECT_TRUE(good.RoundTrip((*target)->regions()[1], 1).ok());
  (*target)->Stop();
}

TEST(HostileTcpTest, ConnectionsPerPeerAreCapped) {
  auto target = PeerProcess::Start(TargetArgs({"--max_per_peer=4"}));
  ASSERT_TRUE(target.ok()) << target.status();
  Dialer hostile;
  ASSERT_TRUE(hostile.Connect((*target)->address()).ok());

  // With its valid token the peer gets 4 serving connections (4 threads), then refusals.
  std::vector<std::unique_ptr<RawConn>> conns;
  for (int i = 0; i < 7; ++i) {
    auto c = RawConn::Open(hostile.data_endpoint());
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->SendHello(hostile.token()).ok());
    absl::StatusOr<absl::Status> reply = (*c)->ReadHelloReply(absl::Seconds(10));
    ASSERT_TRUE(reply.ok()) << reply.status();
    if (i < 4) {
      EXPECT_TRUE(reply->ok()) << *reply;
    } else {
      EXPECT_EQ(reply->code(), absl::StatusCode::kResourceExhausted) << *reply;
      EXPECT_THAT(reply->message(), HasSubstr("tcp.max_data_connections_per_peer 4")) << *reply;
      EXPECT_TRUE((*c)->WaitClosed(absl::Seconds(5)));
    }
    conns.push_back(std::move(*c));
  }
  EXPECT_EQ(ListenerStat(**target, "refused_over_limit"), 3);
  EXPECT_EQ(ListenerStat(**target, "connections"), 4);

  // Closing one frees its place.
  conns.front().reset();
  absl::Status again = absl::UnknownError("not tried");
  for (const absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
    auto c = RawConn::Open(hostile.data_endpoint());
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->SendHello(hostile.token()).ok());
    absl::StatusOr<absl::Status> reply = (*c)->ReadHelloReply(absl::Seconds(10));
    again = reply.ok() ? *reply : reply.status();
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(again.ok()) << again;

  GoodPeer good;
  ASSERT_TRUE(good.Connect((*target)->address()).ok());
  EXPECT_TRUE(good.RoundTrip((*target)->regions()[0], 0).ok());
  (*target)->Stop();
}

// Data connections run on the transport's fixed I/O pool (tcp_io_pool.h): at the process's
// thread limit a connection with a valid token is still served, not refused.
TEST(HostileTcpTest, AtTheThreadLimitConnectionsAreStillServed) {
  auto target = PeerProcess::Start(TargetArgs({}));
  ASSERT_TRUE(target.ok()) << target.status();
  Dialer hostile;
  ASSERT_TRUE(hostile.Connect((*target)->address()).ok());
  // Wait until the target's own channel to this peer is up: it needs threads too.
  std::string transport;
  for (const absl::Time until = absl::Now() + absl::Seconds(10);
       transport.empty() && absl::Now() < until;) {
    ASSERT_TRUE((*target)->WriteLine("TRANSPORT hostile-tcp").ok());
    absl::StatusOr<std::string> line = (*target)->ReadLine(absl::Seconds(10));
    ASSERT_TRUE(line.ok()) << line.status();
    transport = line->substr(std::min(line->size(), sizeof("TRANSPORT")));
    if (transport.empty()) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_THAT(transport, StartsWith("tcp"));
  ASSERT_TRUE((*target)->WriteLine("LIMIT_THREADS").ok());
  absl::StatusOr<std::string> limited = (*target)->ReadLine(absl::Seconds(10));
  ASSERT_TRUE(limited.ok()) << limited.status();
  ASSERT_EQ(*limited, "LIMIT_THREADS ok");

  // A valid token and no thread to spare: served all the same (no thread per connection).
  for (int i = 0; i < 3; ++i) {
    auto c = RawConn::Open(hostile.data_endpoint());
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->SendHello(hostile.token()).ok());
    absl::StatusOr<absl::Status> reply = (*c)->ReadHelloReply(absl::Seconds(10));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_TRUE(reply->ok()) << *reply;
  }
  EXPECT_EQ(ListenerStat(**target, "thread_failures"), 0);

  ASSERT_TRUE((*target)->WriteLine("UNLIMIT_THREADS").ok());
  absl::StatusOr<std::string> unlimited = (*target)->ReadLine(absl::Seconds(10));
  ASSERT_TRUE(unlimited.ok() && *unlimited == "UNLIMIT_THREADS ok")
      << (unlimited.ok() ? *unlimited : unlimited.status().ToString());
  auto c = RawConn::Open(hostile.data_endpoint());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->SendHello(hostile.token()).ok());
  absl::StatusOr<absl::Status> reply = (*c)->ReadHelloReply(absl::Seconds(10));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_TRUE(reply->ok()) << *reply;

  GoodPeer good;
  ASSERT_TRUE(good.Connect((*target)->address()).ok());
  EXPECT_TRUE(good.RoundTrip((*target)->regions()[0], 0).ok());
  (*target)->Stop();
}

void EncodeOp(uint8_t kind, uint64_t sequence, RegionId region, uint64_t offset, uint64_t length,
              std::byte* out) {
  wire::RequestHeader h;
  h.kind = kind;
  h.sequence = sequence;
  h.transfer_id = 77;
  h.region = region;
  h.offset = offset;
  h.length = length;
  wire::EncodeRequest(h, out);
}

// After `stall` left a data connection stuck inside an op on region 0: the connection is cut
// within the I/O deadline, the peer dropped with the reason, the region can be deregistered
// (nothing pins it any more), and a good peer still moves bytes exactly.
void ExpectStallCutAndPinReleased(PeerProcess& target, Dialer& hostile, RawConn& conn,
                                  const char* what) {
  const RegionId r0 = target.regions()[0];
  absl::SleepFor(absl::Milliseconds(200));  // the target is inside the op now
  const std::string deregistered = Deregister(target, r0);
  EXPECT_THAT(deregistered, StartsWith("ok ")) << deregistered;
  EXPECT_TRUE(conn.WaitClosed(absl::Seconds(5)));
  const absl::StatusOr<absl::Status> closed = hostile.WaitClosed(absl::Seconds(10));
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_THAT(std::string(closed->message()), HasSubstr(what)) << *closed;
  EXPECT_EQ(ListenerStat(target, "stalled_dropped"), 1);

  GoodPeer good;
  ASSERT_TRUE(good.Connect(target.address()).ok());
  EXPECT_TRUE(good.RoundTrip(target.regions()[1], 1).ok());
}

TEST(HostileTcpTest, WriteStalledMidPayloadIsCutAndItsPinReleased) {
  auto target = PeerProcess::Start(TargetArgs({"--io_ms=1000"}));
  ASSERT_TRUE(target.ok()) << target.status();
  Dialer hostile;
  ASSERT_TRUE(hostile.Connect((*target)->address()).ok());
  auto conn = RawConn::Open(hostile.data_endpoint());
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE((*conn)->SendHello(hostile.token()).ok());
  absl::StatusOr<absl::Status> reply = (*conn)->ReadHelloReply(absl::Seconds(10));
  ASSERT_TRUE(reply.ok() && reply->ok()) << (reply.ok() ? *reply : reply.status());

  // A WRITE header promising 64 KiB, 100 bytes of it, then silence.
  std::array<std::byte, wire::kRequestBytes + 100> op{};
  EncodeOp(wire::kKindWrite, 0, (*target)->regions()[0], 0, 64 << 10, op.data());
  ASSERT_TRUE((*conn)->Send(op.data(), op.size()).ok());
  ExpectStallCutAndPinReleased(**target, hostile, **conn, "receiving a WRITE payload");
  (*target)->Stop();
}

TEST(HostileTcpTest, ReadNotTakenIsCutAndItsPinsReleased) {
  auto target = PeerProcess::Start(TargetArgs({"--io_ms=1000"}));
  ASSERT_TRUE(target.ok()) << target.status();
  Dialer hostile;
  ASSERT_TRUE(hostile.Connect((*target)->address()).ok());
  auto conn = RawConn::Open(hostile.data_endpoint(), "", 64 << 10);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE((*conn)->SendHello(hostile.token()).ok());
  absl::StatusOr<absl::Status> reply = (*conn)->ReadHelloReply(absl::Seconds(10));
  ASSERT_TRUE(reply.ok() && reply->ok()) << (reply.ok() ? *reply : reply.status());

  // 64 READs of the whole region (64 MiB, far beyond both socket buffers), never read.
  constexpr int kOps = 64;
  std::vector<std::byte> ops(kOps * wire::kRequestBytes);
  for (int i = 0; i < kOps; ++i) {
    EncodeOp(wire::kKindRead, i, (*target)->regions()[0], 0, kRegionBytes,
             ops.data() + i * wire::kRequestBytes);
  }
  ASSERT_TRUE((*conn)->Send(ops.data(), ops.size()).ok());
  ExpectStallCutAndPinReleased(**target, hostile, **conn, "sending responses");
  (*target)->Stop();
}

}  // namespace
}  // namespace kvwire::testing
