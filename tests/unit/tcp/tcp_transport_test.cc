// The tcp transport end to end over loopback: two (or three) Transport instances in one
// process, the target backed by a fake engine (FakeTargetHooks) with a small region table.
#include "transport/tcp/tcp_transport.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/mutex.h"
#include "tests/support/fake_target_hooks.h"
#include "tests/support/tcp_backend.h"
#include "transport/tcp/tcp_io_pool.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"
#include "transport/transport.h"

namespace kvwire::transport {
namespace {

using ::kvwire::testing::FakeTargetHooks;

namespace wire = tcp_wire;

constexpr std::byte kPoison{0xA5};
// Generous: this runs on small, noisy machines and under sanitizers.
constexpr absl::Duration kWait = absl::Seconds(60);

// Records the done() calls of many Posts: how often each ran and with what.
class DoneTracker {
 public:
  DoneCallback Callback(size_t index) {
    {
      MutexLock lock(&mu_);
      if (calls_.size() <= index) {
        calls_.resize(index + 1, 0);
        statuses_.resize(index + 1);
      }
    }
    return [this, index](absl::Status status) {
      MutexLock lock(&mu_);
      ++calls_[index];
      statuses_[index] = std::move(status);
      ++total_;
      cv_.SignalAll();
    };
  }
  // Waits until `n` calls were made in all; false on timeout.
  bool WaitAll(size_t n, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    MutexLock lock(&mu_);
    while (total_ < n) {
      if (!cv_.WaitUntil(&mu_, deadline) && total_ < n) return false;
    }
    return true;
  }
  int calls(size_t i) {
    MutexLock lock(&mu_);
    return calls_[i];
  }
  absl::Status status(size_t i) {
    MutexLock lock(&mu_);
    return statuses_[i];
  }
  size_t total() {
    MutexLock lock(&mu_);
    return total_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<int> calls_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
};

struct Node {
  FakeTargetHooks hooks;
  std::unique_ptr<Transport> transport;
};

const ::testing::Environment* const kBackendEnvironment = ::testing::AddGlobalTestEnvironment(
    new kvwire::testing::TcpBackendEnvironment);  // NOLINT: gtest owns it

std::unique_ptr<Node> MakeNode(TcpTransportOptions options = TcpTransportOptions()) {
  options.io_backend = kvwire::testing::TcpTestBackend();
  auto node = std::make_unique<Node>();
  absl::StatusOr<std::unique_ptr<Transport>> t = CreateTcpTransport(options, &node->hooks);
  EXPECT_TRUE(t.ok()) << t.status();
  if (t.ok()) node->transport = *std::move(t);
  return node;
}

PeerLink LinkTo(const Node& target, const std::string& token, uint32_t lanes) {
  PeerLink link;
  link.peer = 1;
  link.peer_name = "target";
  link.remote_endpoint = target.transport->Endpoint();
  link.token = token;
  link.lanes = lanes;
  link.deadline = absl::Now() + absl::Seconds(20);
  return link;
}

std::unique_ptr<Channel> ConnectOrDie(Node& from, const Node& to, const std::string& token,
                                      uint32_t lanes) {
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      from.transport->Connect(LinkTo(to, token, lanes));
  EXPECT_TRUE(channel.ok()) << channel.status();
  return channel.ok() ? *std::move(channel) : nullptr;
}

absl::Status PostAndWait(Channel& channel, PostRequest request) {
  DoneTracker tracker;
  channel.Post(std::move(request), tracker.Callback(0));
  if (!tracker.WaitAll(1, kWait)) return absl::DeadlineExceededError("done() never ran");
  return tracker.status(0);
}

void FillRandom(std::byte* data, size_t length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= length; i += 8) {
    const uint64_t v = rng();
    std::memcpy(data + i, &v, 8);
  }
  for (; i < length; ++i) data[i] = static_cast<std::byte>(rng());
}

struct PlannedOp {
  uint64_t local_offset;
  uint64_t remote_offset;
  uint64_t length;
};

// Non-overlapping ops (so the result does not depend on their order) with random sizes from
// 1 B to `max_len` (log-uniform: many small, some large), random gaps, shuffled.
std::vector<PlannedOp> PlanOps(std::mt19937_64& rng, uint64_t span, uint64_t max_len) {
  std::vector<PlannedOp> ops;
  std::uniform_real_distribution<double> log_len(0.0, std::log2(static_cast<double>(max_len)));
  std::uniform_int_distribution<uint64_t> gap(0, 4096);
  uint64_t local = gap(rng);
  uint64_t remote = gap(rng);
  while (true) {
    const uint64_t len =
        std::clamp<uint64_t>(static_cast<uint64_t>(std::exp2(log_len(rng))), 1, max_len);
    if (local + len > span || remote + len > span) break;
    ops.push_back({local, remote, len});
    local += len + gap(rng);
    remote += len + gap(rng);
  }
  // Local and remote orders differ too: shuffle the local placement among ops of one size
  // class is overkill; shuffling the submission order is what matters for the wire.
  std::shuffle(ops.begin(), ops.end(), rng);
  return ops;
}

// Splits `ops` into Posts of up to `per_post` ops on lanes 0..lanes-1, waits for all.
absl::Status RunOps(Channel& channel, OpKind kind, const std::vector<PlannedOp>& ops,
                    std::byte* local, RegionId remote_region, uint32_t lanes, size_t per_post,
                    TransferId transfer_id, bool count_arrivals = false) {
  DoneTracker tracker;
  size_t posts = 0;
  for (size_t i = 0; i < ops.size(); i += per_post) {
    PostRequest request;
    request.transfer_id = transfer_id;
    request.kind = kind;
    request.lane = static_cast<uint32_t>(posts % lanes);
    request.count_arrivals = count_arrivals;
    for (size_t j = i; j < std::min(ops.size(), i + per_post); ++j) {
      request.ops.push_back(
          {local + ops[j].local_offset, remote_region, ops[j].remote_offset, ops[j].length});
    }
    channel.Post(std::move(request), tracker.Callback(posts));
    ++posts;
  }
  if (!tracker.WaitAll(posts, kWait)) {
    return absl::DeadlineExceededError(absl::StrCat(
        tracker.total(), " of ", posts, " done() calls in ", absl::FormatDuration(kWait)));
  }
  for (size_t i = 0; i < posts; ++i) {
    if (tracker.calls(i) != 1) {
      return absl::InternalError(absl::StrCat("post ", i, " done() ran ", tracker.calls(i)));
    }
    if (!tracker.status(i).ok()) return tracker.status(i);
  }
  return absl::OkStatus();
}

// What `dst` must hold after the ops copied `src` into it (poison elsewhere).
std::vector<std::byte> Expected(const std::byte* src, uint64_t span,
                                const std::vector<PlannedOp>& ops, bool remote_is_dst) {
  std::vector<std::byte> expected(span, kPoison);
  for (const PlannedOp& op : ops) {
    const uint64_t from = remote_is_dst ? op.local_offset : op.remote_offset;
    const uint64_t to = remote_is_dst ? op.remote_offset : op.local_offset;
    std::memcpy(expected.data() + to, src + from, op.length);
  }
  return expected;
}

// Index of the first differing byte, or -1.
int64_t FirstDifference(const std::byte* a, const std::byte* b, size_t length) {
  if (std::memcmp(a, b, length) == 0) return -1;
  for (size_t i = 0; i < length; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

class TcpTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TcpTransportOptions options;
    options.max_op_bytes = 4 << 20;  // the random ops go up to 3 MiB unsplit
    initiator_ = MakeNode(options);
    target_ = MakeNode(options);
    ASSERT_NE(initiator_->transport, nullptr);
    ASSERT_NE(target_->transport, nullptr);
    target_->hooks.AddToken("token-a", kPeerA);
    target_->hooks.AddToken("token-c", kPeerC);
  }

  static constexpr PeerId kPeerA = 7;
  static constexpr PeerId kPeerC = 8;
  std::unique_ptr<Node> initiator_;
  std::unique_ptr<Node> target_;
};

TEST_F(TcpTransportTest, ReportsCapabilitiesAndEndpoint) {
  const Capabilities& caps = target_->transport->caps();
  EXPECT_EQ(caps.name, "tcp");
  EXPECT_TRUE(caps.one_sided_read);
  EXPECT_TRUE(caps.one_sided_write);
  EXPECT_TRUE(caps.counts_arrivals);
  EXPECT_FALSE(caps.same_host_only);
  EXPECT_EQ(caps.max_op_bytes, 4u << 20);
  EXPECT_EQ(caps.max_lanes, 16u);
  const std::string endpoint = target_->transport->Endpoint();
  EXPECT_EQ(endpoint.rfind("127.0.0.1:", 0), 0u) << endpoint;
  EXPECT_NE(endpoint, "127.0.0.1:0");
  EXPECT_TRUE(initiator_->transport->CanReach(endpoint).ok());
  EXPECT_FALSE(initiator_->transport->CanReach("no-port").ok());

  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 3);
  ASSERT_NE(channel, nullptr);
  EXPECT_EQ(channel->Describe(), "tcp x3 " + endpoint);
  EXPECT_TRUE(channel->AddRemoteRegions({}).ok());
}

TEST_F(TcpTransportTest, RegisterRegionRejectsDuplicates) {
  std::vector<std::byte> memory(64);
  LocalRegion region;
  region.id = 5;
  region.base = memory.data();
  region.length = memory.size();
  region.access = kRemoteReadWrite;
  EXPECT_TRUE(target_->transport->RegisterRegion(region).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(target_->transport->RegisterRegion(region)));
  target_->transport->DeregisterRegion(5);
  EXPECT_TRUE(target_->transport->RegisterRegion(region).ok());
}

TEST_F(TcpTransportTest, RandomWritesAndReadsAreExact) {
  constexpr uint64_t kSpan = 48 << 20;
  const RegionId remote = target_->hooks.AllocateRegion(kSpan, kRemoteReadWrite);
  std::byte* remote_data = target_->hooks.data(remote);
  std::vector<std::byte> local(kSpan);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 4);
  ASSERT_NE(channel, nullptr);

  std::mt19937_64 rng(20240611);
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    const std::vector<PlannedOp> ops = PlanOps(rng, kSpan, 3 << 20);
    ASSERT_GT(ops.size(), 10u);

    // WRITE: local (random) -> remote (poisoned).
    FillRandom(local.data(), kSpan, rng());
    ASSERT_TRUE(target_->hooks.WaitPinsReleased(kWait));
    std::fill_n(remote_data, kSpan, kPoison);
    ASSERT_TRUE(
        RunOps(*channel, OpKind::kWrite, ops, local.data(), remote, 4, 1 + round * 7, 100 + round)
            .ok());
    ASSERT_TRUE(target_->hooks.WaitPinsReleased(kWait));
    std::vector<std::byte> expected = Expected(local.data(), kSpan, ops, /*remote_is_dst=*/true);
    EXPECT_EQ(FirstDifference(expected.data(), remote_data, kSpan), -1);

    // READ: remote (random) -> local (poisoned).
    ASSERT_TRUE(target_->hooks.WaitPinsReleased(kWait));
    FillRandom(remote_data, kSpan, rng());
    std::fill(local.begin(), local.end(), kPoison);
    ASSERT_TRUE(
        RunOps(*channel, OpKind::kRead, ops, local.data(), remote, 4, 1 + round * 7, 200 + round)
            .ok());
    expected = Expected(remote_data, kSpan, ops, /*remote_is_dst=*/false);
    EXPECT_EQ(FirstDifference(expected.data(), local.data(), kSpan), -1);
  }
  EXPECT_TRUE(target_->hooks.peer_errors().empty());
  // Every pin of the target is released once its op was done.
  EXPECT_TRUE(target_->hooks.WaitPinsReleased(kWait));
}

TEST_F(TcpTransportTest, ZeroLengthOpsAndEmptyPostsComplete) {
  const RegionId remote = target_->hooks.AllocateRegion(4096, kRemoteReadWrite);
  std::vector<std::byte> local(4096);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 1);
  ASSERT_NE(channel, nullptr);
  PostRequest empty;
  EXPECT_TRUE(PostAndWait(*channel, std::move(empty)).ok());
  for (OpKind kind : {OpKind::kWrite, OpKind::kRead}) {
    PostRequest request;
    request.kind = kind;
    request.transfer_id = 3;
    request.ops = {{local.data(), remote, 0, 0},
                   {local.data(), remote, 4096, 0},
                   {local.data(), remote, 10, 1}};
    EXPECT_TRUE(PostAndWait(*channel, std::move(request)).ok());
  }
}

TEST_F(TcpTransportTest, ManyPostsInFlightOnSeveralLanes) {
  constexpr uint64_t kSpan = 16 << 20;
  const RegionId remote = target_->hooks.AllocateRegion(kSpan, kRemoteReadWrite);
  std::byte* remote_data = target_->hooks.data(remote);
  std::vector<std::byte> local(kSpan);
  FillRandom(local.data(), kSpan, 1);
  std::fill_n(remote_data, kSpan, kPoison);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 4);
  ASSERT_NE(channel, nullptr);

  // 512 Posts of 8 ops of 4 KiB, everything posted before anything is waited for.
  constexpr size_t kPosts = 512;
  constexpr size_t kOpsPerPost = 8;
  constexpr uint64_t kOpBytes = 4096;
  DoneTracker tracker;
  for (size_t p = 0; p < kPosts; ++p) {
    PostRequest request;
    request.transfer_id = 1000 + p;
    request.kind = OpKind::kWrite;
    request.lane = static_cast<uint32_t>(p);
    for (size_t i = 0; i < kOpsPerPost; ++i) {
      const uint64_t offset = (p * kOpsPerPost + i) * kOpBytes;
      request.ops.push_back({local.data() + offset, remote, offset, kOpBytes});
    }
    channel->Post(std::move(request), tracker.Callback(p));
  }
  ASSERT_TRUE(tracker.WaitAll(kPosts, kWait));
  for (size_t p = 0; p < kPosts; ++p) {
    EXPECT_EQ(tracker.calls(p), 1);
    EXPECT_TRUE(tracker.status(p).ok()) << tracker.status(p);
  }
  ASSERT_TRUE(target_->hooks.WaitPinsReleased(kWait));
  EXPECT_EQ(std::memcmp(local.data(), remote_data, kPosts * kOpsPerPost * kOpBytes), 0);
}

TEST_F(TcpTransportTest, CountsEachFlaggedWriteArrivalOnce) {
  constexpr uint64_t kSpan = 8 << 20;
  const RegionId remote = target_->hooks.AllocateRegion(kSpan, kRemoteReadWrite);
  std::vector<std::byte> local(kSpan);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 4);
  ASSERT_NE(channel, nullptr);
  std::mt19937_64 rng(5);
  const std::vector<PlannedOp> ops = PlanOps(rng, kSpan, 256 << 10);
  ASSERT_TRUE(RunOps(*channel, OpKind::kWrite, ops, local.data(), remote, 4, 3, 42,
                     /*count_arrivals=*/true)
                  .ok());
  ASSERT_TRUE(
      RunOps(*channel, OpKind::kWrite, ops, local.data(), remote, 4, 3, 43, /*count=*/false).ok());
  ASSERT_TRUE(
      RunOps(*channel, OpKind::kRead, ops, local.data(), remote, 4, 3, 44, /*count=*/true).ok());
  EXPECT_EQ(target_->hooks.arrivals(kPeerA, 42), static_cast<int>(ops.size()));
  EXPECT_EQ(target_->hooks.arrivals(kPeerA, 43), 0);
  EXPECT_EQ(target_->hooks.arrivals(kPeerA, 44), 0);  // READs are never counted
}

struct InvalidCase {
  std::string name;
  OpKind kind;
  uint32_t access;
  bool exported;
  bool unknown_region;
  uint64_t offset;
  uint64_t length;
  absl::StatusCode code;
  std::string message;

  friend void PrintTo(const InvalidCase& c, std::ostream* os) { *os << c.name; }
};

class TcpInvalidOpTest : public TcpTransportTest,
                         public ::testing::WithParamInterface<InvalidCase> {};

TEST_P(TcpInvalidOpTest, FailsThePostAndDropsOnlyThatConnection) {
  const InvalidCase& c = GetParam();
  constexpr uint64_t kRegionBytes = 1 << 20;
  const RegionId good = target_->hooks.AllocateRegion(kRegionBytes, kRemoteReadWrite);
  const RegionId bad = target_->hooks.AllocateRegion(kRegionBytes, c.access, c.exported);
  const RegionId target_region = c.unknown_region ? 999 : bad;
  std::vector<std::byte> local(2 << 20);
  FillRandom(local.data(), local.size(), 9);

  auto failing = ConnectOrDie(*initiator_, *target_, "token-a", 1);
  auto healthy = ConnectOrDie(*initiator_, *target_, "token-a", 2);
  std::unique_ptr<Node> other = MakeNode();
  auto other_peer = ConnectOrDie(*other, *target_, "token-c", 1);
  ASSERT_TRUE(failing && healthy && other_peer);

  // Valid ops first, then the invalid one (op 2), then more behind it.
  PostRequest request;
  request.transfer_id = 42;
  request.kind = c.kind;
  request.ops = {{local.data(), good, 0, 1000},
                 {local.data() + 1000, good, 1000, 1000},
                 {local.data(), target_region, c.offset, c.length},
                 {local.data(), good, 5000, 1000}};
  DoneTracker tracker;
  failing->Post(std::move(request), tracker.Callback(0));
  // A second Post queued behind it on the same connection must fail too, not hang.
  PostRequest behind;
  behind.transfer_id = 43;
  behind.kind = OpKind::kWrite;
  behind.ops = {{local.data() + (1 << 20), good, 64 << 10, 64 << 10}};
  failing->Post(std::move(behind), tracker.Callback(1));
  ASSERT_TRUE(tracker.WaitAll(2, kWait));
  const absl::Status s = tracker.status(0);
  EXPECT_EQ(s.code(), c.code) << s;
  EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
  EXPECT_NE(s.message().find("transfer 42"), std::string::npos) << s;
  EXPECT_NE(s.message().find("op 2"), std::string::npos) << s;
  EXPECT_NE(s.message().find(target_->transport->Endpoint()), std::string::npos) << s;
  EXPECT_FALSE(tracker.status(1).ok());
  EXPECT_EQ(tracker.calls(0), 1);
  EXPECT_EQ(tracker.calls(1), 1);

  ASSERT_TRUE(target_->hooks.WaitPeerErrors(1, kWait));
  const auto errors = target_->hooks.peer_errors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].first, kPeerA);
  EXPECT_EQ(errors[0].second.code(), c.code);
  EXPECT_NE(errors[0].second.message().find(c.message), std::string::npos) << errors[0].second;
  EXPECT_NE(errors[0].second.message().find("op 2 of transfer 42"), std::string::npos)
      << errors[0].second;

  // The failed lane stays failed; other channels and peers keep working.
  PostRequest again;
  again.transfer_id = 44;
  again.ops = {{local.data(), good, 0, 10}};
  EXPECT_FALSE(PostAndWait(*failing, std::move(again)).ok());
  for (Channel* ch : {healthy.get(), other_peer.get()}) {
    for (uint32_t lane = 0; lane < 2; ++lane) {
      PostRequest ok;
      ok.transfer_id = 45;
      ok.lane = lane;
      ok.kind = OpKind::kWrite;
      ok.ops = {{local.data(), good, 0, 1 << 20}};
      EXPECT_TRUE(PostAndWait(*ch, std::move(ok)).ok());
    }
  }
  ASSERT_TRUE(target_->hooks.WaitPinsReleased(kWait));
  EXPECT_EQ(std::memcmp(target_->hooks.data(good), local.data(), 1 << 20), 0);
  EXPECT_EQ(target_->hooks.peer_errors().size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TcpInvalidOpTest,
    ::testing::Values(
        InvalidCase{"UnknownRegion", OpKind::kWrite, kRemoteReadWrite, true, true, 0, 10,
                    absl::StatusCode::kNotFound, "remote region 999 is not exported"},
        InvalidCase{"NotExported", OpKind::kRead, kRemoteReadWrite, false, false, 0, 10,
                    absl::StatusCode::kNotFound, "is not exported to peer 7"},
        InvalidCase{"WriteOutOfBounds", OpKind::kWrite, kRemoteReadWrite, true, false,
                    (1 << 20) - 100, 101, absl::StatusCode::kOutOfRange,
                    "offset 1048476 length 101 exceeds region length 1048576"},
        InvalidCase{"ReadOffsetOverflow", OpKind::kRead, kRemoteReadWrite, true, false,
                    UINT64_MAX - 5, 10, absl::StatusCode::kOutOfRange, "exceeds region length"},
        InvalidCase{"WriteToReadOnly", OpKind::kWrite, kRemoteRead, true, false, 0, 10,
                    absl::StatusCode::kPermissionDenied, "does not allow remote WRITE"},
        InvalidCase{"ReadFromWriteOnly", OpKind::kRead, kRemoteWrite, true, false, 0, 10,
                    absl::StatusCode::kPermissionDenied, "does not allow remote READ"}),
    [](const ::testing::TestParamInfo<InvalidCase>& info) { return info.param.name; });

TEST_F(TcpTransportTest, RefusesUnknownToken) {
  absl::StatusOr<std::unique_ptr<Channel>> channel =
      initiator_->transport->Connect(LinkTo(*target_, "wrong-token", 2));
  ASSERT_FALSE(channel.ok());
  EXPECT_TRUE(absl::IsUnauthenticated(channel.status())) << channel.status();
  EXPECT_NE(channel.status().message().find(target_->transport->Endpoint()), std::string::npos)
      << channel.status();
  EXPECT_NE(channel.status().message().find("unknown session token"), std::string::npos);
  EXPECT_TRUE(target_->hooks.peer_errors().empty());
  // The target still serves good tokens.
  EXPECT_NE(ConnectOrDie(*initiator_, *target_, "token-a", 1), nullptr);
}

TEST_F(TcpTransportTest, ConnectErrorsNameTheEndpoint) {
  // Nothing listens on a port we bound and closed.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string closed_endpoint = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  PeerLink link = LinkTo(*target_, "token-a", 1);
  link.remote_endpoint = closed_endpoint;
  absl::StatusOr<std::unique_ptr<Channel>> channel = initiator_->transport->Connect(link);
  ASSERT_FALSE(channel.ok());
  EXPECT_TRUE(absl::IsUnavailable(channel.status())) << channel.status();
  EXPECT_NE(channel.status().message().find(closed_endpoint), std::string::npos);

  // A listener that never answers the hello: the deadline ends the wait.
  ASSERT_EQ(::listen(fd, 4), 0);
  link.deadline = absl::Now() + absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  channel = initiator_->transport->Connect(link);
  ASSERT_FALSE(channel.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(channel.status())) << channel.status();
  EXPECT_NE(channel.status().message().find(closed_endpoint), std::string::npos);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ::close(fd);

  link.remote_endpoint = "not-an-endpoint";
  EXPECT_TRUE(absl::IsInvalidArgument(initiator_->transport->Connect(link).status()));
  link = LinkTo(*target_, "token-a", 17);  // more than max_lanes
  EXPECT_TRUE(absl::IsInvalidArgument(initiator_->transport->Connect(link).status()));
}

TEST_F(TcpTransportTest, CloseFailsEveryPendingPostExactlyOnce) {
  constexpr uint64_t kSpan = 8 << 20;
  const RegionId remote = target_->hooks.AllocateRegion(kSpan, kRemoteReadWrite);
  std::vector<std::byte> local(kSpan);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 4);
  ASSERT_NE(channel, nullptr);

  // Hold every op on the target so that nothing can complete before Close.
  target_->hooks.SetGate(false);
  constexpr size_t kPosts = 64;
  DoneTracker tracker;
  for (size_t p = 0; p < kPosts; ++p) {
    PostRequest request;
    request.transfer_id = p;
    request.kind = p % 2 ? OpKind::kRead : OpKind::kWrite;
    request.lane = static_cast<uint32_t>(p);
    // Disjoint ops: 2 x 64 KiB per Post.
    for (uint64_t i = 0; i < 2; ++i) {
      const uint64_t off = (p * 2 + i) * (64 << 10);
      request.ops.push_back({local.data() + off, remote, off, 64 << 10});
    }
    channel->Post(std::move(request), tracker.Callback(p));
  }
  absl::SleepFor(absl::Milliseconds(50));  // let the writers put some on the wire
  EXPECT_EQ(tracker.total(), 0u);
  channel->Close(absl::AbortedError("test closes the channel"));
  ASSERT_TRUE(tracker.WaitAll(kPosts, kWait));
  target_->hooks.SetGate(true);
  // A Post after Close fails inline.
  PostRequest late;
  late.transfer_id = 999;
  late.ops = {{local.data(), remote, 0, 10}};
  DoneTracker late_tracker;
  channel->Post(std::move(late), late_tracker.Callback(0));
  EXPECT_EQ(late_tracker.total(), 1u);
  EXPECT_TRUE(absl::IsAborted(late_tracker.status(0))) << late_tracker.status(0);

  absl::SleepFor(absl::Milliseconds(200));  // any second call would show up now
  for (size_t p = 0; p < kPosts; ++p) {
    EXPECT_EQ(tracker.calls(p), 1) << p;
    const absl::Status s = tracker.status(p);
    EXPECT_TRUE(absl::IsAborted(s)) << s;
    EXPECT_NE(s.message().find("test closes the channel"), std::string::npos) << s;
    EXPECT_NE(s.message().find(absl::StrCat("transfer ", p)), std::string::npos) << s;
  }
  channel->Close(absl::InternalError("second close is a no-op"));
  channel.reset();
  EXPECT_EQ(tracker.total(), kPosts);
}

TEST_F(TcpTransportTest, CloseRacingPostsStillCallsEveryDone) {
  const RegionId remote = target_->hooks.AllocateRegion(4 << 20, kRemoteReadWrite);
  std::vector<std::byte> local(4 << 20);
  for (int round = 0; round < 20; ++round) {
    auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 2);
    ASSERT_NE(channel, nullptr);
    DoneTracker tracker;
    constexpr size_t kPosts = 200;
    std::thread poster([&] {
      for (size_t p = 0; p < kPosts; ++p) {
        PostRequest request;
        request.transfer_id = p;
        request.lane = static_cast<uint32_t>(p);
        const uint64_t off = p * (16 << 10);  // disjoint
        request.ops = {{local.data() + off, remote, off, 16 << 10}};
        channel->Post(std::move(request), tracker.Callback(p));
      }
    });
    absl::SleepFor(absl::Microseconds(100 * round));
    channel->Close(absl::CancelledError("racing close"));
    poster.join();
    ASSERT_TRUE(tracker.WaitAll(kPosts, kWait)) << tracker.total();
    for (size_t p = 0; p < kPosts; ++p) ASSERT_EQ(tracker.calls(p), 1);
  }
}

TEST_F(TcpTransportTest, PeerShutdownMidTransferFailsPendingPosts) {
  constexpr uint64_t kSpan = 32 << 20;
  const RegionId remote = target_->hooks.AllocateRegion(kSpan, kRemoteReadWrite);
  std::vector<std::byte> local(kSpan);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 4);
  ASSERT_NE(channel, nullptr);
  // Slow the target down so that the transfer is surely still running at Shutdown.
  target_->hooks.SetResolveDelay(absl::Milliseconds(2));
  constexpr size_t kPosts = 64;
  DoneTracker tracker;
  for (size_t p = 0; p < kPosts; ++p) {
    PostRequest request;
    request.transfer_id = p;
    request.kind = p % 2 ? OpKind::kRead : OpKind::kWrite;
    request.lane = static_cast<uint32_t>(p);
    // Disjoint ops: 4 x 128 KiB per Post.
    for (uint64_t i = 0; i < 4; ++i) {
      const uint64_t off = (p * 4 + i) * (128 << 10);
      request.ops.push_back({local.data() + off, remote, off, 128 << 10});
    }
    channel->Post(std::move(request), tracker.Callback(p));
  }
  absl::SleepFor(absl::Milliseconds(30));
  const absl::Time start = absl::Now();
  target_->transport->Shutdown();
  ASSERT_TRUE(tracker.WaitAll(kPosts, absl::Seconds(20))) << tracker.total();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  size_t failed = 0;
  for (size_t p = 0; p < kPosts; ++p) {
    EXPECT_EQ(tracker.calls(p), 1);
    const absl::Status s = tracker.status(p);
    if (!s.ok()) {
      ++failed;
      EXPECT_TRUE(absl::IsUnavailable(s)) << s;
      EXPECT_NE(s.message().find(target_->transport->Endpoint()), std::string::npos) << s;
    }
  }
  EXPECT_GT(failed, 0u);
  // The shut-down target refuses new channels.
  PeerLink link = LinkTo(*target_, "token-a", 1);
  link.deadline = absl::Now() + absl::Seconds(5);
  EXPECT_FALSE(initiator_->transport->Connect(link).ok());
}

TEST_F(TcpTransportTest, CancelledReadDoesNotWriteLocalMemory) {
  constexpr uint64_t kBytes = 2 << 20;
  const RegionId remote = target_->hooks.AllocateRegion(kBytes, kRemoteReadWrite);
  FillRandom(target_->hooks.data(remote), kBytes, 3);
  std::vector<std::byte> local(kBytes, kPoison);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 1);
  ASSERT_NE(channel, nullptr);

  // Cancelled before it was posted.
  PostRequest request;
  request.transfer_id = 77;
  request.kind = OpKind::kRead;
  request.cancelled = std::make_shared<std::atomic<bool>>(true);
  request.ops = {{local.data(), remote, 0, 1 << 20}, {local.data() + (1 << 20), remote, 0, 10}};
  const absl::Status s = PostAndWait(*channel, std::move(request));
  EXPECT_TRUE(absl::IsCancelled(s)) << s;

  // Cancelled while the target holds it.
  target_->hooks.SetGate(false);
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  PostRequest held;
  held.transfer_id = 78;
  held.kind = OpKind::kRead;
  held.cancelled = cancelled;
  held.ops = {{local.data(), remote, 0, kBytes}};
  DoneTracker tracker;
  channel->Post(std::move(held), tracker.Callback(0));
  absl::SleepFor(absl::Milliseconds(20));
  cancelled->store(true);
  target_->hooks.SetGate(true);
  ASSERT_TRUE(tracker.WaitAll(1, kWait));
  EXPECT_TRUE(absl::IsCancelled(tracker.status(0))) << tracker.status(0);
  EXPECT_TRUE(std::all_of(local.begin(), local.end(), [](std::byte b) { return b == kPoison; }));

  // Many cancelled ops answered in one batch (read-ahead across discarded payloads).
  std::vector<std::byte> big(8 * (300 << 10), kPoison);
  PostRequest many;
  many.transfer_id = 80;
  many.kind = OpKind::kRead;
  many.cancelled = std::make_shared<std::atomic<bool>>(true);
  for (uint64_t i = 0; i < 8; ++i) {
    many.ops.push_back({big.data() + i * (300 << 10), remote, i * 1000, 300 << 10});
  }
  EXPECT_TRUE(absl::IsCancelled(PostAndWait(*channel, std::move(many))));
  EXPECT_TRUE(std::all_of(big.begin(), big.end(), [](std::byte b) { return b == kPoison; }));

  // The connection is still in sync: a normal READ works.
  PostRequest normal;
  normal.transfer_id = 79;
  normal.kind = OpKind::kRead;
  normal.ops = {{local.data(), remote, 0, kBytes}};
  EXPECT_TRUE(PostAndWait(*channel, std::move(normal)).ok());
  EXPECT_EQ(std::memcmp(local.data(), target_->hooks.data(remote), kBytes), 0);
}

// A raw TCP client: what a buggy or hostile peer could send.
class RawClient {
 public:
  explicit RawClient(const std::string& endpoint) {
    std::string host;
    uint16_t port = 0;
    EXPECT_TRUE(ParseEndpoint(endpoint, &host, &port).ok());
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_TRUE(SetIoTimeout(fd_, absl::Seconds(30)).ok());
  }
  ~RawClient() { ::close(fd_); }
  int fd() const { return fd_; }

  void SendHello(const std::string& token, uint32_t magic = wire::kHelloMagic) {
    std::array<std::byte, wire::kHelloBytes> hello;
    wire::Hello h;
    h.token_len = static_cast<uint32_t>(token.size());
    wire::EncodeHello(h, hello.data());
    wire::Store32(hello.data(), magic);
    ASSERT_TRUE(SendAll(fd_, hello.data(), hello.size()).ok());
    ASSERT_TRUE(SendAll(fd_, token.data(), token.size()).ok());
  }
  // The hello reply's code.
  uint32_t ReadHelloReply() {
    std::array<std::byte, wire::kHelloReplyBytes> in;
    EXPECT_TRUE(RecvExact(fd_, in.data(), in.size()).ok());
    wire::HelloReply reply;
    EXPECT_TRUE(wire::DecodeHelloReply(in.data(), &reply).ok());
    std::string message(reply.message_len, '\0');
    EXPECT_TRUE(RecvExact(fd_, message.data(), message.size()).ok());
    return reply.code;
  }
  // Reads one response (and its message); returns its code and message.
  std::pair<uint32_t, std::string> ReadResponse() {
    std::array<std::byte, wire::kResponseBytes> in;
    if (!RecvExact(fd_, in.data(), in.size()).ok()) return {UINT32_MAX, "no response"};
    wire::ResponseHeader h;
    EXPECT_TRUE(wire::DecodeResponse(in.data(), &h).ok());
    std::string message(h.message_len, '\0');
    EXPECT_TRUE(RecvExact(fd_, message.data(), message.size()).ok());
    return {h.code, message};
  }
  // True when the peer closed the stream (after any bytes it still had for us).
  bool SeesEndOfStream() {
    std::array<std::byte, 256> sink;
    while (true) {
      const ssize_t n = ::recv(fd_, sink.data(), sink.size(), 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }

 private:
  int fd_ = -1;
};

TEST_F(TcpTransportTest, MalformedOpHeaderIsAProtocolError) {
  const RegionId remote = target_->hooks.AllocateRegion(1 << 20, kRemoteReadWrite);
  std::vector<std::byte> local(1 << 20);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 1);
  ASSERT_NE(channel, nullptr);

  struct Garbage {
    std::string name;
    std::function<void(std::byte*)> corrupt;
    std::string message;
  };
  const std::vector<Garbage> cases = {
      {"magic", [](std::byte* h) { wire::Store32(h, 0xdeadbeef); }, "bad op header magic"},
      {"kind", [](std::byte* h) { h[4] = std::byte{9}; }, "unknown op kind 9"},
      {"length", [](std::byte* h) { wire::Store64(h + 48, uint64_t{1} << 40); },
       "exceeds max_op_bytes"},
      {"sequence", [](std::byte* h) { wire::Store64(h + 16, 5); }, "op sequence 5, expected 0"},
      {"flags", [](std::byte* h) { h[5] = std::byte{0x80}; }, "bad flags"},
  };
  size_t errors = 0;
  for (const Garbage& g : cases) {
    SCOPED_TRACE(g.name);
    RawClient raw(target_->transport->Endpoint());
    raw.SendHello("token-a");
    ASSERT_EQ(raw.ReadHelloReply(), 0u);
    wire::RequestHeader h;
    h.kind = wire::kKindWrite;
    h.region = remote;
    h.length = 16;
    std::array<std::byte, wire::kRequestBytes> header;
    wire::EncodeRequest(h, header.data());
    g.corrupt(header.data());
    ASSERT_TRUE(SendAll(raw.fd(), header.data(), header.size()).ok());
    const auto [code, message] = raw.ReadResponse();
    EXPECT_EQ(code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_NE(message.find(g.message), std::string::npos) << message;
    EXPECT_TRUE(raw.SeesEndOfStream());
    ASSERT_TRUE(target_->hooks.WaitPeerErrors(++errors, kWait));
    const auto reported = target_->hooks.peer_errors().back();
    EXPECT_EQ(reported.first, kPeerA);
    EXPECT_NE(reported.second.message().find(g.message), std::string::npos) << reported.second;
  }
  // Pure garbage instead of a hello: refused, but there is no peer to blame.
  {
    RawClient raw(target_->transport->Endpoint());
    raw.SendHello("token-a", /*magic=*/0x01020304);
    EXPECT_EQ(raw.ReadHelloReply(), static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_TRUE(raw.SeesEndOfStream());
  }
  EXPECT_EQ(target_->hooks.peer_errors().size(), errors);
  // The server keeps serving: the regular channel still works.
  PostRequest request;
  request.transfer_id = 5;
  request.ops = {{local.data(), remote, 0, 1 << 20}};
  EXPECT_TRUE(PostAndWait(*channel, std::move(request)).ok());
}

TEST_F(TcpTransportTest, DropPeerClosesOnlyThatPeersConnections) {
  const RegionId remote = target_->hooks.AllocateRegion(1 << 20, kRemoteReadWrite);
  std::vector<std::byte> local(1 << 20);
  auto a = ConnectOrDie(*initiator_, *target_, "token-a", 2);
  std::unique_ptr<Node> other = MakeNode();
  auto c = ConnectOrDie(*other, *target_, "token-c", 2);
  ASSERT_TRUE(a && c);
  auto post = [&](Channel& ch, uint32_t lane) {
    PostRequest request;
    request.transfer_id = 1;
    request.lane = lane;
    request.ops = {{local.data(), remote, 0, 64 << 10}};
    return PostAndWait(ch, std::move(request));
  };
  ASSERT_TRUE(post(*a, 0).ok());
  target_->transport->DropPeer(kPeerA);
  for (uint32_t lane = 0; lane < 2; ++lane) {
    const absl::Status s = post(*a, lane);
    EXPECT_TRUE(absl::IsUnavailable(s)) << s;
    EXPECT_TRUE(post(*c, lane).ok());
  }
  // Its token no longer opens data connections; no peer error is reported for a drop.
  absl::StatusOr<std::unique_ptr<Channel>> again =
      initiator_->transport->Connect(LinkTo(*target_, "token-a", 1));
  EXPECT_TRUE(absl::IsUnauthenticated(again.status())) << again.status();
  EXPECT_TRUE(target_->hooks.peer_errors().empty());
}

TEST_F(TcpTransportTest, ChannelDestroyedInsideDoneCallback) {
  const RegionId remote = target_->hooks.AllocateRegion(1 << 20, kRemoteReadWrite);
  std::vector<std::byte> local(1 << 20);
  std::unique_ptr<Channel> channel = ConnectOrDie(*initiator_, *target_, "token-a", 2);
  ASSERT_NE(channel, nullptr);
  Mutex mu;
  CondVar cv;
  bool destroyed = false;
  PostRequest request;
  request.transfer_id = 1;
  request.ops = {{local.data(), remote, 0, 1 << 20}};
  Channel* raw = channel.get();
  raw->Post(std::move(request), [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    channel.reset();  // on the connection's reader thread
    MutexLock lock(&mu);
    destroyed = true;
    cv.SignalAll();
  });
  {
    MutexLock lock(&mu);
    const absl::Time deadline = absl::Now() + kWait;
    while (!destroyed && cv.WaitUntil(&mu, deadline)) {
    }
    ASSERT_TRUE(destroyed);
  }
  // The transport joins the threads the channel could not; then it still works.
  auto next = ConnectOrDie(*initiator_, *target_, "token-a", 1);
  ASSERT_NE(next, nullptr);
  PostRequest more;
  more.transfer_id = 2;
  more.ops = {{local.data(), remote, 0, 100}};
  EXPECT_TRUE(PostAndWait(*next, std::move(more)).ok());
}

TEST_F(TcpTransportTest, ShutdownWithOpenChannels) {
  const RegionId remote = target_->hooks.AllocateRegion(1 << 20, kRemoteReadWrite);
  std::vector<std::byte> local(1 << 20);
  auto channel = ConnectOrDie(*initiator_, *target_, "token-a", 4);
  ASSERT_NE(channel, nullptr);
  initiator_->transport->Shutdown();
  initiator_->transport->Shutdown();  // idempotent
  PostRequest request;
  request.transfer_id = 1;
  request.ops = {{local.data(), remote, 0, 100}};
  const absl::Status s = PostAndWait(*channel, std::move(request));
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  // The channel outlives its transport harmlessly.
  initiator_->transport.reset();
  channel.reset();
}

}  // namespace
}  // namespace kvwire::transport
