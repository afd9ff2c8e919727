// rdma tests that need a device. They run inside the soft-RoCE VM (tests/rdma/vm/), between
// this process and kvwire_test_peer, both forced onto the rdma transport. Deadlines are
// generous: emulated RDMA under TCG is slow and jittery.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <signal.h>
#include <stdlib.h>
#include <thread>

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "proto/kvwire.pb.h"
#include "src/util/fault_injection.h"
#include "src/util/log.h"
#include "src/util/mutex.h"
#include "tests/integration/peer_process.h"
#include "tests/integration/random_ops.h"
#include "tests/integration/test_pattern.h"
#include "tests/rdma/rdma_stats.h"
#include "tests/support/fake_target_hooks.h"
#include "transport/rdma/rdma_transport.h"

namespace kvwire::testing {
namespace {

constexpr uint64_t kRegionBytes = 32 << 20;
constexpr uint64_t kSeed = 11;
constexpr std::byte kPoison{0xEE};

int CountDevices() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list != nullptr) ibv_free_device_list(list);
  return n;
}

class RdmaEngineTest : public ::testing::Test {
 protected:
  void Start(const std::vector<std::string>& devices) {
    setenv("KVWIRE_RDMA_DEVICES", absl::StrJoin(devices, ",").c_str(), 1);
    auto peer = PeerProcess::Start(
        {"--transport=rdma", "--regions=3", absl::StrCat("--region_bytes=", kRegionBytes),
         absl::StrCat("--seed=", kSeed), "--name=rdma-peer", "--lease_ms=3000"},
        absl::Seconds(60));
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = std::move(*peer);
    EngineOptions options;
    options.name = "rdma-tester";
    options.transport = "rdma";
    options.rdma().devices = devices;
    options.peer_lease = absl::Seconds(3);
    options.heartbeat_interval = absl::Milliseconds(300);
    options.connect_timeout = absl::Seconds(30);
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
    local_.assign(128 << 20, kPoison);
    auto id = engine_->RegisterMemory(local_.data(), local_.size());
    ASSERT_TRUE(id.ok()) << id.status();
    local_id_ = *id;
    auto pid = engine_->Connect(peer_->address());
    ASSERT_TRUE(pid.ok()) << pid.status();
    peer_id_ = *pid;
    for (RegionId r : peer_->regions()) {
      ASSERT_TRUE(engine_->WaitForRemoteRegion(peer_id_, r, absl::Seconds(30)).ok());
    }
  }
  void SetUp() override { Start({"rxe0"}); }
  void TearDown() override {
    engine_.reset();
    if (peer_) peer_->Stop();
  }

  absl::Status Run(OpKind kind, const std::vector<Op>& ops,
                   TransferOptions options = TransferOptions()) {
    if (!options.timeout) options.timeout = absl::Seconds(120);
    auto id = engine_->Transfer(peer_id_, kind, ops, options);
    if (!id.ok()) return id.status();
    return engine_->Wait(*id, absl::Seconds(180));
  }

  std::vector<Op> RandomOps(std::mt19937_64& rng, int regions, uint64_t local_limit) {
    return testing::RandomOps(rng, local_id_, local_limit, peer_->regions(), regions, kRegionBytes);
  }

  int RegionIndex(RegionId id) const {
    for (size_t i = 0; i < peer_->regions().size(); ++i)
      if (peer_->regions()[i] == id) return static_cast<int>(i);
    return -1;
  }

  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<Engine> engine_;
  std::vector<std::byte> local_;
  RegionId local_id_ = 0;
  PeerId peer_id_ = 0;
};

TEST_F(RdmaEngineTest, ChosenTransportIsRdmaWithSeveralQps) {
  EngineStats stats = engine_->Stats();
  ASSERT_EQ(stats.peers.size(), 1u);
  EXPECT_NE(stats.peers[0].transport.find("rdma x4"), std::string::npos)
      << stats.peers[0].transport;
  EXPECT_EQ(stats.peers[0].transport_reason, "forced by configuration");
  std::printf("transport: %s\n", stats.peers[0].transport.c_str());
}

// Every byte of the 16 MiB window is checked: op ranges hold the peer's non-repeating pattern
// at their remote offsets, the gaps between them are still poison.
TEST_F(RdmaEngineTest, RandomReadsAreByteExact) {
  std::mt19937_64 rng(1234);
  const uint64_t window = 16 << 20;
  std::vector<std::byte> expected(window);
  for (int round = 0; round < 12; ++round) {
    std::fill(local_.begin(), local_.begin() + window, kPoison);
    std::vector<Op> ops = RandomOps(rng, 3, window);
    ASSERT_FALSE(ops.empty());
    ASSERT_TRUE(Run(OpKind::kRead, ops).ok()) << "round " << round;
    std::fill(expected.begin(), expected.end(), kPoison);
    for (const Op& op : ops) {
      const int r = RegionIndex(op.remote_region);
      for (uint64_t i = 0; i < op.length; ++i) {
        expected[op.local_offset + i] = PatternByte(kSeed, r, op.remote_offset + i);
      }
    }
    const int64_t diff = FirstDifference(local_.data(), expected.data(), window);
    ASSERT_EQ(diff, -1) << "round " << round << ": local byte " << diff;
  }
}

// After each round of WRITEs both writable regions are read back whole and compared with a
// model (the pattern, then every op's bytes): nothing outside the ops moved.
TEST_F(RdmaEngineTest, RandomWritesReadBackByteExact) {
  std::mt19937_64 rng(99);
  const uint64_t half = 16 << 20;
  ASSERT_GE(local_.size(), half + 2 * kRegionBytes);
  std::vector<std::vector<std::byte>> model(2, std::vector<std::byte>(kRegionBytes));
  for (int r = 0; r < 2; ++r) {
    for (uint64_t i = 0; i < kRegionBytes; ++i) model[r][i] = PatternByte(kSeed, r, i);
  }
  for (int round = 0; round < 8; ++round) {
    for (size_t i = 0; i < half; ++i) local_[i] = static_cast<std::byte>(rng());
    std::vector<Op> ops = RandomOps(rng, 2, half);  // regions 0 and 1 are writable
    ASSERT_TRUE(Run(OpKind::kWrite, ops).ok()) << "round " << round;
    for (const Op& op : ops) {
      std::copy_n(local_.begin() + op.local_offset, op.length,
                  model[RegionIndex(op.remote_region)].begin() + op.remote_offset);
    }
    std::fill(local_.begin() + half, local_.begin() + half + 2 * kRegionBytes, kPoison);
    ASSERT_TRUE(Run(OpKind::kRead,
                    {Op{local_id_, half, peer_->regions()[0], 0, kRegionBytes},
                     Op{local_id_, half + kRegionBytes, peer_->regions()[1], 0, kRegionBytes}})
                    .ok());
    for (int r = 0; r < 2; ++r) {
      const int64_t diff =
          FirstDifference(local_.data() + half + r * kRegionBytes, model[r].data(), kRegionBytes);
      ASSERT_EQ(diff, -1) << "round " << round << " region " << r << " offset " << diff;
    }
  }
}

TEST_F(RdmaEngineTest, NotificationArrivesAfterDataIsVisible) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 6; ++round) {
    const uint64_t slice = kRegionBytes / 6;
    const uint64_t length = 1 + rng() % std::min<uint64_t>(slice, 3 << 20);
    const uint64_t offset = round * slice;
    for (uint64_t i = 0; i < length; ++i) local_[i] = static_cast<std::byte>(rng());
    const uint64_t fnv = Fnv1a(local_.data(), length);
    std::vector<Op> ops;  // many ops: striped over the QPs, arrivals counted per transfer
    for (uint64_t done = 0; done < length;) {
      const uint64_t len = std::min<uint64_t>(length - done, 1 + rng() % (128 << 10));
      ops.push_back(Op{local_id_, done, peer_->regions()[0], offset + done, len});
      done += len + (rng() % 2 ? 0 : 0);
    }
    TransferOptions options;
    options.notification =
        absl::StrCat("check:", peer_->regions()[0], ":", offset, ":", length, ":", fnv);
    options.timeout = absl::Seconds(120);
    auto id = engine_->Transfer(peer_id_, OpKind::kWrite, ops, options);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(engine_->Wait(*id, absl::Seconds(180)).ok());
    auto line = peer_->ReadLine(absl::Seconds(60));
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_EQ(*line, absl::StrCat("NOTIFY ", *id, " ok")) << "round " << round;
  }
}

// A DeepSeek-V4-like request: thousands of 4-40 KB pieces scattered over the peer's two
// writable regions, written with a notification, then read back. The transport's posting
// counters (ibv_post_send calls, signalled WRs, pieces) are logged when the engine stops.
TEST_F(RdmaEngineTest, ThousandsOfSmallPiecesAreByteExact) {
  std::mt19937_64 rng(77);
  const uint64_t half = local_.size() / 2;
  for (uint64_t i = 0; i + 8 <= half; i += 8) {
    const uint64_t word = rng();
    std::memcpy(local_.data() + i, &word, 8);
  }
  std::vector<Op> ops;
  uint64_t local = 0;
  uint64_t remote[2] = {0, 0};
  while (ops.size() < 2500) {
    const uint64_t len = 4096 + rng() % (40960 - 4096);
    const uint64_t gap = 4096 * (rng() % 2);
    const int r = rng() % 2;
    if (local + len > half || remote[r] + gap + len > kRegionBytes) break;
    ops.push_back(Op{local_id_, local, peer_->regions()[r], remote[r] + gap, len});
    local += len;
    remote[r] += gap + len;
  }
  ASSERT_GE(ops.size(), 2000u);
  const RdmaStats before = RdmaOf(engine_->Stats());
  const absl::Time start = absl::Now();
  TransferOptions options;
  options.notification = "many";
  options.timeout = absl::Seconds(150);
  auto id = engine_->Transfer(peer_id_, OpKind::kWrite, ops, options);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(engine_->Wait(*id, absl::Seconds(180)).ok());
  auto line = peer_->ReadLine(absl::Seconds(60));
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, absl::StrCat("NOTIFY ", *id, " bad"));  // "many" is not a check request
  // The posting path, as EngineStats reports it: WRs gather pieces (remote-contiguous ones
  // merge), chains need far fewer ibv_post_send calls than WRs, few WRs are signalled, and
  // the 8-byte slot binds go inline.
  const RdmaStats after = RdmaOf(engine_->Stats());
  const uint64_t wrs = after.work_requests - before.work_requests;
  const uint64_t calls = after.post_calls - before.post_calls;
  const uint64_t signalled = after.signalled - before.signalled;
  const uint64_t inlined = after.inline_wrs - before.inline_wrs;
  const uint64_t queued = after.queued_wrs - before.queued_wrs;
  EXPECT_GT(wrs, 0u);
  EXPECT_LE(wrs, ops.size() + 64);  // pieces, plus one bind per counted lane
  EXPECT_LT(calls, wrs / 4);
  EXPECT_LT(signalled, wrs / 4);
  EXPECT_GE(inlined, 1u);
  EXPECT_EQ(after.completion_errors, before.completion_errors);
  std::printf(
      "%zu pieces: %llu WRs, %llu ibv_post_send calls, %llu signalled, %llu inline, %llu "
      "queued by admission control; per 1000 pieces: %.1f post calls, %.1f signalled\n",
      ops.size(), static_cast<unsigned long long>(wrs), static_cast<unsigned long long>(calls),
      static_cast<unsigned long long>(signalled), static_cast<unsigned long long>(inlined),
      static_cast<unsigned long long>(queued), 1000.0 * calls / ops.size(),
      1000.0 * signalled / ops.size());
  const std::string json = engine_->Stats().ToJson();
  EXPECT_NE(json.find(absl::StrCat("\"post_calls\":", after.post_calls)), std::string::npos)
      << json;
  const std::string prom = engine_->Stats().ToPrometheus("t");
  EXPECT_NE(prom.find("kvwire_rdma_post_calls_total{engine=\"t\"}"), std::string::npos);
  std::vector<Op> back = ops;
  for (Op& op : back) op.local_offset += half;
  ASSERT_TRUE(Run(OpKind::kRead, back).ok());
  for (const Op& op : ops) {
    ASSERT_EQ(0, std::memcmp(local_.data() + op.local_offset,
                             local_.data() + op.local_offset + half, op.length));
  }
  std::printf("%zu pieces written and read back in %s (emulated: not a performance figure)\n",
              ops.size(), absl::FormatDuration(absl::Now() - start).c_str());
  SetLogLevel(LogLevel::kInfo);  // the transport's counters, when the engine stops
  engine_.reset();
  SetLogLevel(LogLevel::kWarning);
}

TEST_F(RdmaEngineTest, KilledPeerFailsTransfersWithinTheirDeadline) {
  // A thread keeps READs flowing (soft-RoCE moves data inside ibv_post_send, so submitting
  // is slow) while the peer is killed; every transfer must end within its deadline.
  TransferOptions options;
  options.timeout = absl::Seconds(40);
  Mutex mu;
  std::vector<TransferId> ids;
  int refused = 0;
  std::atomic<bool> stop{false};
  std::thread submitter([&] {
    for (int i = 0; i < 2000 && !stop; ++i) {
      auto id = engine_->Transfer(
          peer_id_, OpKind::kRead,
          {Op{local_id_, (i % 8) * (1ull << 20), peer_->regions()[i % 3], 0, 1 << 20}}, options);
      MutexLock lock(&mu);
      if (id.ok()) {
        ids.push_back(*id);
      } else {
        ++refused;  // the peer is already known dead
      }
    }
  });
  absl::SleepFor(absl::Seconds(2));
  const absl::Time killed = absl::Now();
  peer_->Signal(SIGKILL);
  absl::SleepFor(absl::Seconds(1));
  stop = true;
  submitter.join();
  int failed = 0;
  std::string first_error;
  std::vector<TransferId> submitted;
  {
    MutexLock lock(&mu);
    submitted = ids;
  }
  for (TransferId id : submitted) {
    absl::Status s = engine_->Wait(id, absl::Seconds(60));
    EXPECT_NE(s.code(), absl::StatusCode::kDeadlineExceeded) << "Wait itself timed out: " << s;
    if (!s.ok() && failed++ == 0) first_error = s.ToString();
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(45));  // within the 40 s transfer deadline
  bool dead = false;
  while (!dead && absl::Now() - killed < absl::Seconds(30)) {
    for (const PeerInfo& p : engine_->Peers()) dead = dead || (p.id == peer_id_ && !p.alive);
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(dead);
  // Under emulation the submitter may not get a turn between the kill and `stop`: one more
  // transfer, now that the peer is known dead, must be refused or fail.
  auto late = engine_->Transfer(peer_id_, OpKind::kRead,
                                {Op{local_id_, 0, peer_->regions()[0], 0, 4096}}, options);
  if (!late.ok()) {
    ++refused;
  } else if (absl::Status s = engine_->Wait(*late, absl::Seconds(60)); !s.ok()) {
    EXPECT_NE(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    if (failed++ == 0) first_error = s.ToString();
  }
  EXPECT_GT(failed + refused, 0);
  std::printf(
      "%zu transfers submitted, %d failed, %d refused after death; all ended %s after the "
      "kill; first error: %s\n",
      submitted.size(), failed, refused, absl::FormatDuration(absl::Now() - killed).c_str(),
      first_error.c_str());
}

// rxe0 sits on dummy0 (tests/rdma/vm/init). Taking the netdev down makes the kernel raise
// IBV_EVENT_PORT_ERR on rxe0 in every process that opened it; bringing it up, PORT_ACTIVE.
absl::Status SetLink(const char* state) {
  const std::string command = absl::StrCat("ip link set dev dummy0 ", state);
  if (int rc = std::system(command.c_str()); rc != 0) {
    return absl::InternalError(absl::StrCat(command, ": exit ", rc));
  }
  return absl::OkStatus();
}

TEST_F(RdmaEngineTest, PortErrorFailsTransfersAtOnceAndTheEngineRecovers) {
  // READs stream while the port goes down: those in flight fail at once naming the event
  // (the QPs' own retries would take far longer), new ones are refused while it is down,
  // and after the port is ACTIVE again the QPs are re-created on next use.
  TransferOptions options;
  options.timeout = absl::Seconds(60);
  Mutex mu;
  std::vector<TransferId> ids;
  std::atomic<bool> stop{false};
  std::thread submitter([&] {
    for (int i = 0; i < 4000 && !stop; ++i) {
      auto id = engine_->Transfer(
          peer_id_, OpKind::kRead,
          {Op{local_id_, (i % 8) * (1ull << 20), peer_->regions()[i % 3], 0, 1 << 20}}, options);
      if (id.ok()) {
        MutexLock lock(&mu);
        ids.push_back(*id);
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  absl::SleepFor(absl::Seconds(2));
  const RdmaStats before = RdmaOf(engine_->Stats());
  const absl::Time down = absl::Now();
  ASSERT_TRUE(SetLink("down").ok());
  absl::SleepFor(absl::Milliseconds(500));
  stop = true;
  submitter.join();
  std::vector<TransferId> submitted;
  {
    MutexLock lock(&mu);
    submitted = ids;
  }
  int ok = 0, by_event = 0, other = 0;
  std::string event_error, other_error;
  absl::Time last_end = down;
  for (TransferId id : submitted) {
    absl::Status s = engine_->Wait(id, absl::Seconds(90));
    ASSERT_NE(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    last_end = std::max(last_end, absl::Now());
    if (s.ok()) {
      ++ok;
    } else if (s.message().find("port error") != std::string::npos) {
      if (by_event++ == 0) event_error = s.ToString();
    } else if (other++ == 0) {
      other_error = s.ToString();
    }
  }
  std::printf(
      "%zu READs: %d ok, %d failed naming the port error, %d otherwise; last ended "
      "%s after link down\n  event error: %s\n  other error: %s\n",
      submitted.size(), ok, by_event, other, absl::FormatDuration(last_end - down).c_str(),
      event_error.c_str(), other_error.c_str());
  EXPECT_GT(by_event, 0);
  EXPECT_EQ(other, 0) << other_error;
  EXPECT_LT(last_end - down, absl::Seconds(20));  // far below the 60 s transfer deadline
  const RdmaStats after = RdmaOf(engine_->Stats());
  EXPECT_GT(after.async_events, before.async_events);

  // While the port is down, a new transfer is refused at once, naming the event.
  const absl::Time refused_at = absl::Now();
  absl::Status refused =
      Run(OpKind::kRead, {Op{local_id_, 0, peer_->regions()[0], 0, 4096}}, options);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_NE(refused.message().find("port error"), std::string::npos) << refused;
  EXPECT_LT(absl::Now() - refused_at, absl::Seconds(5));
  std::printf("while down: %s\n", refused.ToString().c_str());

  ASSERT_TRUE(SetLink("up").ok());
  const absl::Time up = absl::Now();
  absl::Status s;
  int attempts = 0;
  do {  // both processes must have seen PORT_ACTIVE
    std::fill(local_.begin(), local_.begin() + (1 << 20), kPoison);
    s = Run(OpKind::kRead, {Op{local_id_, 0, peer_->regions()[1], 4096, 1 << 20}}, options);
    ++attempts;
    if (!s.ok()) absl::SleepFor(absl::Milliseconds(200));
  } while (!s.ok() && absl::Now() - up < absl::Seconds(60));
  ASSERT_TRUE(s.ok()) << s;
  for (uint64_t i = 0; i < (1 << 20); i += 4099) {
    ASSERT_EQ(local_[i], PatternByte(kSeed, 1, 4096 + i));
  }
  EXPECT_GT(RdmaOf(engine_->Stats()).qp_reconnects, before.qp_reconnects);
  bool alive = false;
  for (const PeerInfo& p : engine_->Peers()) alive = alive || (p.id == peer_id_ && p.alive);
  EXPECT_TRUE(alive);
  std::printf("after link up: READ ok after %d attempt(s), %s\n", attempts,
              absl::FormatDuration(absl::Now() - up).c_str());
}

// The VM the stage boots has the devices the tests expect (tests/rdma/vm/run_in_vm.sh sets
// KVWIRE_VM_EXPECT_DEVICES): asserted here, so a VM with fewer fails instead of skipping.
TEST(RdmaVmEnvironment, HasTheDevicesTheTestsExpect) {
  const char* expected = std::getenv("KVWIRE_VM_EXPECT_DEVICES");
  ASSERT_NE(expected, nullptr) << "run by tests/rdma/vm/run_in_vm.sh, which sets it";
  EXPECT_EQ(CountDevices(), std::atoi(expected));
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ASSERT_NE(list, nullptr);
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.push_back(ibv_get_device_name(list[i]));
  ibv_free_device_list(list);
  for (const char* want : {"rxe0", "rxe1"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end())
        << want << " missing; devices: " << absl::StrJoin(names, ",");
  }
}

// Two rxe devices in one VM (on two dummy interfaces): QPs on both, transfers striped.
class RdmaTwoDevicesTest : public RdmaEngineTest {
 protected:
  void SetUp() override {
    // The VM creates two rxe devices (tests/rdma/vm/init) and the stage fails if it did not,
    // so fewer here is a failure, not a skip.
    ASSERT_GE(CountDevices(), 2) << "the VM should have rxe0 and rxe1";
    Start({"rxe0", "rxe1"});
  }
};

TEST_F(RdmaTwoDevicesTest, StripesOverBothDevices) {
  EngineStats stats = engine_->Stats();
  ASSERT_EQ(stats.peers.size(), 1u);
  const std::string& t = stats.peers[0].transport;
  EXPECT_NE(t.find("rxe0"), std::string::npos) << t;
  EXPECT_NE(t.find("rxe1"), std::string::npos) << t;
  std::printf("transport: %s\n", t.c_str());
  std::vector<Op> ops;
  for (int i = 0; i < 64; ++i) {
    ops.push_back(
        Op{local_id_, i * (128ull << 10), peer_->regions()[i % 3], i * (128ull << 10), 128 << 10});
  }
  ASSERT_TRUE(Run(OpKind::kRead, ops).ok());
  for (const Op& op : ops) {
    const int r = RegionIndex(op.remote_region);
    for (uint64_t i = 0; i < op.length; ++i) {
      ASSERT_EQ(local_[op.local_offset + i], PatternByte(kSeed, r, op.remote_offset + i));
    }
  }
}

// --- leak check: a full connect-transfer-disconnect cycle, both ends in this process -------
// Run by tests/rdma/vm/run_in_vm.sh under valgrind --leak-check=full --error-exitcode (any
// definite or indirect leak, or an invalid access, fails the VM stage); excluded from the
// plain run. Both engines live here so that initiator and target code are both checked.
TEST(RdmaLeakCheck, ConnectTransferDisconnectCycle) {
  EngineOptions base;
  base.transport = "rdma";
  base.rdma().devices = {"rxe0"};
  base.rdma().qps_per_peer = 1;
  base.connect_timeout = absl::Seconds(120);
  base.peer_lease = absl::Seconds(120);  // valgrind under TCG is slow; no false deaths
  EngineOptions a_options = base, b_options = base;
  a_options.name = "leak-a";
  b_options.name = "leak-b";
  auto a = Engine::Create(a_options);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = Engine::Create(b_options);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<std::byte> a_mem(256 << 10), b_mem(256 << 10, std::byte{0});
  for (size_t i = 0; i < a_mem.size(); ++i) a_mem[i] = static_cast<std::byte>(i * 7);
  auto a_region = (*a)->RegisterMemory(a_mem.data(), a_mem.size());
  ASSERT_TRUE(a_region.ok()) << a_region.status();
  RegionOptions exported;
  exported.export_to_all_peers = true;
  auto b_region = (*b)->RegisterMemory(b_mem.data(), b_mem.size(), exported);
  ASSERT_TRUE(b_region.ok()) << b_region.status();
  auto b_at_a = (*a)->Connect((*b)->address());
  ASSERT_TRUE(b_at_a.ok()) << b_at_a.status();
  ASSERT_TRUE((*a)->WaitForRemoteRegion(*b_at_a, *b_region, absl::Seconds(120)).ok());
  EXPECT_NE((*a)->Stats().peers[0].transport.find("rdma"), std::string::npos);

  TransferOptions options;
  options.timeout = absl::Seconds(120);
  options.notification = "leak-check";
  std::vector<Op> ops;
  for (uint64_t off = 0; off < a_mem.size(); off += 40 << 10) {
    ops.push_back(
        Op{*a_region, off, *b_region, off, std::min<uint64_t>(40 << 10, a_mem.size() - off)});
  }
  auto write = (*a)->Transfer(*b_at_a, OpKind::kWrite, ops, options);
  ASSERT_TRUE(write.ok()) << write.status();
  ASSERT_TRUE((*a)->Wait(*write, absl::Seconds(120)).ok());
  auto note = (*b)->WaitNotification(absl::Seconds(120));
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(note->payload, "leak-check");
  EXPECT_EQ(0, std::memcmp(a_mem.data(), b_mem.data(), a_mem.size()));
  std::fill(a_mem.begin(), a_mem.end(), std::byte{0});
  options.notification.reset();
  auto read = (*a)->Transfer(*b_at_a, OpKind::kRead, ops, options);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE((*a)->Wait(*read, absl::Seconds(120)).ok());
  EXPECT_EQ(0, std::memcmp(a_mem.data(), b_mem.data(), a_mem.size()));

  ASSERT_TRUE((*a)->Disconnect(*b_at_a).ok());
  ASSERT_TRUE((*a)->DeregisterMemory(*a_region).ok());
  ASSERT_TRUE((*b)->DeregisterMemory(*b_region).ok());
  a->reset();
  b->reset();
}

// --- end-to-end checksums (EngineOptions::verify_checksums; docs/CHECKSUMS.md) ---------------

// A byte flipped between the NIC and memory (the rdma test hook: after a READ's completion at
// the initiator, before the target's CRC of a WRITE's destination) fails the transfer with
// DataLoss when the pair verifies; without it the READ's flipped byte lands as a success.
TEST(RdmaChecksums, AFlippedByteFailsTheTransferOnlyWhenVerifying) {
  namespace fi = fault_injection;
  for (const bool verify : {true, false}) {
    SCOPED_TRACE(verify ? "verify" : "no verify");
    EngineOptions base;
    base.transport = "rdma";
    base.rdma().devices = {"rxe0"};
    base.rdma().qps_per_peer = 2;
    base.connect_timeout = absl::Seconds(60);
    base.peer_lease = absl::Seconds(60);
    EngineOptions a_options = base, b_options = base;
    a_options.name = "crc-a";
    b_options.name = "crc-b";
    a_options.verify_checksums = verify;  // the initiator asks; the pair uses it
    std::vector<std::byte> a_mem(1 << 20), b_mem(1 << 20);
    for (size_t i = 0; i < b_mem.size(); ++i) b_mem[i] = static_cast<std::byte>(i * 13 + 5);
    auto a = Engine::Create(a_options);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = Engine::Create(b_options);
    ASSERT_TRUE(b.ok()) << b.status();
    auto a_region = (*a)->RegisterMemory(a_mem.data(), a_mem.size());
    ASSERT_TRUE(a_region.ok()) << a_region.status();
    RegionOptions exported;
    exported.export_to_all_peers = true;
    auto b_region = (*b)->RegisterMemory(b_mem.data(), b_mem.size(), exported);
    ASSERT_TRUE(b_region.ok()) << b_region.status();
    auto peer = (*a)->Connect((*b)->address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE((*a)->WaitForRemoteRegion(*peer, *b_region, absl::Seconds(60)).ok());
    EXPECT_EQ((*a)->Stats().peers[0].transport.find("+crc32c") != std::string::npos, verify)
        << (*a)->Stats().peers[0].transport;
    std::vector<Op> ops;
    for (uint64_t off = 0; off < a_mem.size(); off += 256 << 10) {
      ops.push_back(Op{*a_region, off, *b_region, off, 256 << 10});
    }
    auto run = [&](OpKind kind) -> absl::Status {
      TransferOptions options;
      options.timeout = absl::Seconds(120);
      auto id = (*a)->Transfer(*peer, kind, ops, options);
      if (!id.ok()) return id.status();
      return (*a)->Wait(*id, absl::Seconds(180));
    };
    // Clean: exact both ways.
    ASSERT_TRUE(run(OpKind::kRead).ok());
    EXPECT_EQ(0, std::memcmp(a_mem.data(), b_mem.data(), a_mem.size()));
    ASSERT_TRUE(run(OpKind::kWrite).ok());
    // READ with a flipped byte.
    fi::ArmPayloadFlips(fi::Site::kRdma, 1);
    absl::Status s = run(OpKind::kRead);
    if (verify) {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_NE(s.message().find("checksum mismatch"), std::string::npos) << s;
      EXPECT_NE(s.message().find("crc-b"), std::string::npos) << "names the peer: " << s;
      EXPECT_EQ(fi::PayloadFlipsLeft(fi::Site::kRdma), 0);
    } else {
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(fi::PayloadFlipsLeft(fi::Site::kRdma), 0);
      EXPECT_NE(0, std::memcmp(a_mem.data(), b_mem.data(), a_mem.size()))
          << "the flipped byte did not land";
    }
    if (verify) {
      // WRITE whose destination differs from its source when the target computes its CRC.
      fi::ArmPayloadFlips(fi::Site::kRdma, 1);
      s = run(OpKind::kWrite);
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_EQ(fi::PayloadFlipsLeft(fi::Site::kRdma), 0);
    }
    fi::ArmPayloadFlips(fi::Site::kRdma, 0);
    // The path stays usable.
    ASSERT_TRUE(run(OpKind::kRead).ok());
    EXPECT_EQ(0, std::memcmp(a_mem.data(), b_mem.data(), a_mem.size()));
    a->reset();
    b->reset();
  }
}

// --- transport level: a remote range beyond the peer's registration ---------------------------

// Two transports in one process; their "control channel" is a direct call, as the engine's
// is a TransportControl envelope (opaque payload) on its TCP connection. The target knows the
// initiator as peer 7.
transport::ControlSender DirectControl(transport::Transport* initiator,
                                       transport::Transport* target) {
  return [initiator, target](std::string request) {
    target->OnControlMessage(7, request, [initiator](std::string reply) {
      initiator->OnControlMessage(1, reply, nullptr);
      return absl::OkStatus();
    });
    return absl::OkStatus();
  };
}

absl::Status PostAndWait(transport::Channel& channel, transport::PostRequest request) {
  Mutex mu;
  CondVar cv;
  std::optional<absl::Status> result;
  channel.Post(std::move(request), [&](absl::Status s) {
    MutexLock lock(&mu);
    result = std::move(s);
    cv.SignalAll();
  });
  MutexLock lock(&mu);
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (!result && absl::Now() < deadline) cv.WaitUntil(&mu, deadline);
  return result.value_or(absl::DeadlineExceededError("no completion in 120 s"));
}

TEST(RdmaTransportTest, RemoteRangeBeyondRegistrationFailsAndTheQpRecovers) {
  // The target knows the initiator as peer 7, by its token "tok"; RDMA ops are one-sided.
  FakeTargetHooks target_hooks(OnePeer("tok", 7, /*pid=*/0));
  FakeTargetHooks initiator_hooks(OnePeer("tok", 7, /*pid=*/0));
  transport::RdmaTransportOptions options;
  options.devices = {"rxe0"};
  options.qps_per_device = 1;
  options.qp_timeout = 10;
  options.retry_count = 3;
  auto target = transport::CreateRdmaTransport(options, &target_hooks);
  ASSERT_TRUE(target.ok()) << target.status();
  auto initiator = transport::CreateRdmaTransport(options, &initiator_hooks);
  ASSERT_TRUE(initiator.ok()) << initiator.status();

  std::vector<std::byte> remote(64 << 10, std::byte{0});
  std::vector<std::byte> local(1 << 20, std::byte{0x5A});
  transport::LocalRegion r;
  r.id = 1;
  r.base = remote.data();
  r.length = remote.size();
  r.access = kRemoteReadWrite;
  ASSERT_TRUE((*target)->RegisterRegion(r).ok());
  transport::LocalRegion l;
  l.id = 2;
  l.base = local.data();
  l.length = local.size();
  l.access = kRemoteReadWrite;
  ASSERT_TRUE((*initiator)->RegisterRegion(l).ok());

  transport::PeerLink link;
  link.peer = 1;
  link.peer_name = "target";
  link.remote_endpoint = (*target)->Endpoint();
  link.send_control = DirectControl(initiator->get(), target->get());
  link.deadline = absl::Now() + absl::Seconds(30);
  auto channel = (*initiator)->Connect(link);
  ASSERT_TRUE(channel.ok()) << channel.status();
  transport::RemoteRegionDesc desc;
  desc.id = 1;
  desc.length = 1 << 20;  // a lie: the MR is 64 KiB
  desc.access = kRemoteReadWrite;
  desc.address = reinterpret_cast<uint64_t>(remote.data());
  auto key = (*target)->ExportKey(7, 1);  // 7: the peer DirectControl names the initiator
  ASSERT_TRUE(key.ok()) << key.status();
  ASSERT_TRUE(desc.SetKey(*key));
  ASSERT_TRUE((*channel)->AddRemoteRegions({desc}).ok());

  transport::PostRequest bad;
  bad.transfer_id = 41;
  bad.kind = OpKind::kWrite;
  bad.ops = {transport::WireOp{local.data(), 1, 512 << 10, 4096, -1, /*local_region=*/2}};
  absl::Status s = PostAndWait(**channel, std::move(bad));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("remote access error"), std::string::npos) << s;
  EXPECT_NE(s.message().find("transfer 41"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rxe0:1"), std::string::npos) << s;
  EXPECT_NE(s.message().find("QP "), std::string::npos) << s;
  std::printf("error: %s\n", s.ToString().c_str());

  // The QP is re-created on next use; counted WRITE with many pieces, then a READ.
  transport::PostRequest good;
  good.transfer_id = (1ull << 40) + 5;  // a 64-bit id survives the 32-bit immediate
  good.kind = OpKind::kWrite;
  good.count_arrivals = true;
  for (int i = 0; i < 16; ++i) {
    good.ops.push_back(transport::WireOp{local.data() + i * 8192, 1, uint64_t(i) * 4096, 4096, -1,
                                         /*local_region=*/2});
  }
  s = PostAndWait(**channel, std::move(good));
  ASSERT_TRUE(s.ok()) << s;
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (target_hooks.arrivals((1ull << 40) + 5) < 16 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(target_hooks.arrivals((1ull << 40) + 5), 16);
  EXPECT_EQ(remote[0], std::byte{0x5A});
  EXPECT_EQ(remote[(64 << 10) - 1], std::byte{0x5A});

  std::fill(local.begin(), local.end(), std::byte{0});
  transport::PostRequest read;
  read.transfer_id = 43;
  read.kind = OpKind::kRead;
  read.ops = {transport::WireOp{local.data(), 1, 0, 64 << 10, -1, /*local_region=*/2}};
  s = PostAndWait(**channel, std::move(read));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(local[100], std::byte{0x5A});

  // The target's QPs vanish (as when its process dies): the next READ gets no answer, fails
  // after the QP's retries with a clear error, and the QP after that is re-created.
  (*target)->DropPeer(7);
  const absl::Time lost = absl::Now();
  transport::PostRequest orphan;
  orphan.transfer_id = 44;
  orphan.kind = OpKind::kRead;
  orphan.ops = {transport::WireOp{local.data(), 1, 0, 4096, -1, /*local_region=*/2}};
  s = PostAndWait(**channel, std::move(orphan));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("transfer 44"), std::string::npos) << s;
  std::printf("dead target: %s after %s\n", s.ToString().c_str(),
              absl::FormatDuration(absl::Now() - lost).c_str());
  EXPECT_LT(absl::Now() - lost, absl::Seconds(60));
  // The dropped peer's keys went with it: the re-created QP reaches nothing with the old one.
  transport::PostRequest stale;
  stale.transfer_id = 45;
  stale.kind = OpKind::kRead;
  stale.ops = {transport::WireOp{local.data(), 1, 0, 4096, -1, /*local_region=*/2}};
  s = PostAndWait(**channel, std::move(stale));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("remote access error"), std::string::npos) << s;
  // Exported again: a fresh key, and the next QP works.
  key = (*target)->ExportKey(7, 1);
  ASSERT_TRUE(key.ok()) << key.status();
  ASSERT_TRUE(desc.SetKey(*key));
  ASSERT_TRUE((*channel)->AddRemoteRegions({desc}).ok());
  transport::PostRequest again;
  again.transfer_id = 46;
  again.kind = OpKind::kRead;
  again.ops = {transport::WireOp{local.data(), 1, 0, 4096, -1, /*local_region=*/2}};
  s = PostAndWait(**channel, std::move(again));
  EXPECT_TRUE(s.ok()) << s;

  (*channel)->Close(absl::CancelledError("test done"));
  (*initiator)->DropPeer(1);
  (*target)->DropPeer(7);
  (*initiator)->DeregisterRegion(2);
  (*target)->DeregisterRegion(1);
}

}  // namespace
}  // namespace kvwire::testing
