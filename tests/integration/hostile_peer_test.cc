// A hostile peer: it completes a real handshake, then bypasses its own engine's checks and
// sends ops the target never exported. The target must refuse each with a clear error, drop
// only that peer, and keep serving everyone else.
#include <algorithm>
#include <thread>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "src/control/control.h"
#include "src/util/mutex.h"
#include "tests/integration/peer_process.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/fake_target_hooks.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace kvwire::testing {
namespace {

constexpr uint64_t kRegionBytes = 1 << 20;

struct Hostile {
  boost::asio::io_context io;
  std::unique_ptr<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work;
  std::thread io_thread;
  FakeTargetHooks hooks{AnyToken(1)};  // serves nothing: it only initiates
  std::unique_ptr<transport::Transport> tcp;
  std::shared_ptr<control::Connection> conn;
  std::unique_ptr<transport::Channel> channel;
  Mutex mu;
  CondVar cv;
  bool closed ABSL_GUARDED_BY(mu) = false;
  absl::Status close_status ABSL_GUARDED_BY(mu);

  ~Hostile() {
    if (channel) channel->Close(absl::CancelledError("test over"));
    if (conn) conn->Close(absl::CancelledError("test over"));
    if (tcp) tcp->Shutdown();
    work.reset();
    io.stop();
    if (io_thread.joinable()) io_thread.join();
  }

  absl::Status Connect(const std::string& address, uint64_t compat_salt) {
    work =
        std::make_unique<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>>(
            io.get_executor());
    io_thread = std::thread([this] { io.run(); });
    auto t = transport::CreateTcpTransport(transport::TcpTransportOptions(), &hooks);
    if (!t.ok()) return t.status();
    tcp = std::move(*t);
    pb::Hello hello;
    hello.set_engine_name("hostile");
    hello.set_pid(static_cast<uint32_t>(getpid()));
    hello.set_session_token("hostile-token");
    hello.set_transport_preference("tcp");
    pb::TransportEndpoint* ep = hello.add_transports();
    ep->set_kind("tcp");
    ep->set_endpoint(tcp->Endpoint());
    control::HandshakeConfig config;
    config.compat_hash = control::CompatibilityHash(compat_salt);
    auto accepted = control::Dial(io, address, hello, config);
    if (!accepted.ok()) return accepted.status();
    conn = accepted->connection;
    conn->Start([](const pb::Envelope&) {},
                [this](const absl::Status& s) {
                  MutexLock lock(&mu);
                  closed = true;
                  close_status = s;
                  cv.SignalAll();
                },
                absl::Milliseconds(200), absl::Seconds(30));
    std::string endpoint;
    for (const auto& t : accepted->remote_hello.transports())
      if (t.kind() == "tcp") endpoint = t.endpoint();
    transport::PeerLink link;
    link.peer = 1;
    link.peer_name = accepted->remote_hello.engine_name();
    link.remote_endpoint = endpoint;
    link.token = accepted->remote_hello.session_token();
    link.lanes = 1;
    link.deadline = absl::Now() + absl::Seconds(10);
    auto channel_or = tcp->Connect(link);
    if (!channel_or.ok()) return channel_or.status();
    channel = std::move(*channel_or);
    return absl::OkStatus();
  }

  absl::Status Post(OpKind kind, RegionId region, uint64_t offset, uint64_t length,
                    std::byte* local) {
    transport::PostRequest request;
    request.transfer_id = 1;
    request.kind = kind;
    request.ops.push_back(transport::WireOp{local, region, offset, length});
    request.cancelled = std::make_shared<std::atomic<bool>>(false);
    auto done = std::make_shared<std::pair<Mutex, std::optional<absl::Status>>>();
    auto done_cv = std::make_shared<CondVar>();
    channel->Post(std::move(request), [done, done_cv](absl::Status s) {
      MutexLock lock(&done->first);
      done->second = std::move(s);
      done_cv->SignalAll();
    });
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    MutexLock lock(&done->first);
    while (!done->second.has_value() && absl::Now() < deadline) {
      done_cv->WaitUntil(&done->first, deadline);
    }
    if (!done->second.has_value()) return absl::DeadlineExceededError("post never completed");
    return *done->second;
  }

  absl::Status WaitClosed(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    MutexLock lock(&mu);
    while (!closed && absl::Now() < deadline) cv.WaitUntil(&mu, deadline);
    if (!closed) return absl::DeadlineExceededError("the target did not drop the hostile peer");
    return close_status;
  }
};

struct Case {
  const char* name;
  OpKind kind;
  int region_index;  // -1: a region id never exported
  uint64_t offset;
  uint64_t length;
  const char* expect_in_message;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class HostilePeerTest : public ::testing::TestWithParam<Case> {};

TEST_P(HostilePeerTest, RefusedClearlyAndOnlyThatPeerIsDropped) {
  const Case& c = GetParam();
  auto target = PeerProcess::Start({"--transport=auto", "--regions=2",
                                    absl::StrCat("--region_bytes=", kRegionBytes), "--seed=5"});
  ASSERT_TRUE(target.ok()) << target.status();

  // A well-behaved engine connected to the same target throughout.
  auto good = Engine::Create(EngineOptions());
  ASSERT_TRUE(good.ok());
  std::vector<std::byte> buf(kRegionBytes);
  auto local = (*good)->RegisterMemory(buf.data(), buf.size());
  ASSERT_TRUE(local.ok());
  auto good_peer = (*good)->Connect((*target)->address());
  ASSERT_TRUE(good_peer.ok()) << good_peer.status();
  const RegionId r0 = (*target)->regions()[0];
  ASSERT_TRUE((*good)->WaitForRemoteRegion(*good_peer, r0, absl::Seconds(10)).ok());

  Hostile hostile;
  ASSERT_TRUE(hostile.Connect((*target)->address(), 0).ok());
  // A valid op first: the hostile peer really is connected and served.
  std::vector<std::byte> scratch(2 * kRegionBytes);
  ASSERT_TRUE(hostile.Post(OpKind::kRead, r0, 0, 4096, scratch.data()).ok());
  EXPECT_EQ(scratch[10], PatternByte(5, 0, 10));

  const RegionId region = c.region_index < 0 ? 987654 : (*target)->regions()[c.region_index];
  absl::Status refused = hostile.Post(c.kind, region, c.offset, c.length, scratch.data());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find(c.expect_in_message), std::string::npos) << refused;
  EXPECT_NE(refused.message().find(absl::StrCat(region)), std::string::npos) << refused;

  // Dropped: its control connection is closed by the target.
  absl::Status closed = hostile.WaitClosed(absl::Seconds(15));
  EXPECT_NE(closed.code(), absl::StatusCode::kDeadlineExceeded) << closed;

  // Everyone else is still served, and the target's memory was not touched.
  // Every byte of both regions (the read-write one and the read-only one) is read back and
  // compared, so an in-range piece of a refused op that slipped through is seen anywhere.
  const std::vector<RegionId>& regions = (*target)->regions();
  for (size_t r = 0; r < regions.size(); ++r) {
    ASSERT_TRUE((*good)->WaitForRemoteRegion(*good_peer, regions[r], absl::Seconds(10)).ok());
    std::fill(buf.begin(), buf.end(), std::byte{0});
    auto id =
        (*good)->Transfer(*good_peer, OpKind::kRead, {Op{*local, 0, regions[r], 0, kRegionBytes}});
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE((*good)->Wait(*id, absl::Seconds(30)).ok());
    for (uint64_t i = 0; i < kRegionBytes; ++i) {
      ASSERT_EQ(buf[i], PatternByte(5, r, i)) << "region " << r << " byte " << i;
    }
  }
  (*target)->Stop();
}

INSTANTIATE_TEST_SUITE_P(
    Ops, HostilePeerTest,
    ::testing::Values(Case{"WriteBeyondEnd", OpKind::kWrite, 0, kRegionBytes - 10, 100, "exceeds"},
                      Case{"ReadBeyondEnd", OpKind::kRead, 0, kRegionBytes, 1, "exceeds"},
                      Case{"OffsetOverflow", OpKind::kRead, 0, UINT64_MAX - 10, 100, "exceeds"},
                      Case{"UnknownRegion", OpKind::kWrite, -1, 0, 100, "not exported"},
                      Case{"WriteToReadOnlyRegion", OpKind::kWrite, 1, 0, 100, "does not allow"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace kvwire::testing
