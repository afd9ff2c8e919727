// Public engine API that the other tests do not reach: EngineOptions::FromEnvironment,
// ConnectOptions::exports and ::transport, Engine::Export, Poll, FindPeer and
// TakeNotifications. Real engines on loopback (in this process, or kvwire_test_peer where a
// peer must be frozen).
#include <algorithm>
#include <cstring>
#include <signal.h>
#include <stdlib.h>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "tests/integration/peer_process.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/scoped_env.h"

namespace kvwire::testing {
namespace {

TEST(EngineOptionsTest, FromEnvironmentTakesEachValidVariable) {
  ScopedEnv env({{"KVWIRE_LISTEN", "127.0.0.1:4567"},
                 {"KVWIRE_TRANSPORT", "tcp"},
                 {"KVWIRE_TCP_CONNECTIONS", "7"},
                 {"KVWIRE_TCP_IO_POLL", "50us"},
                 {"KVWIRE_TCP_IO_THREADS", "2"},
                 {"KVWIRE_SECRET", "s3cret"},
                 {"KVWIRE_SHM_CMA", "1"},
                 {"KVWIRE_VERIFY_CHECKSUMS", "1"},
                 {"KVWIRE_RDMA_DEVICES", "mlx5_0,,mlx5_1"},
                 {"KVWIRE_RDMA_GID_INDEX", "3"},
                 {"KVWIRE_RDMA_QPS", "9"},
                 {"KVWIRE_RDMA_SEND_QUEUE_DEPTH", "512"}});
  absl::StatusOr<EngineOptions> got = EngineOptions::FromEnvironment(EngineOptions());
  ASSERT_TRUE(got.ok()) << got.status();
  const EngineOptions& o = *got;
  EXPECT_EQ(o.listen_address, "127.0.0.1:4567");
  EXPECT_EQ(o.transport, "tcp");
  EXPECT_EQ(o.tcp().connections, 7);
  EXPECT_EQ(o.tcp().io_poll, absl::Microseconds(50));
  EXPECT_EQ(o.tcp().io_threads, 2);
  EXPECT_EQ(o.shared_secret, "s3cret");
  EXPECT_TRUE(o.shm().cma);
  EXPECT_FALSE(o.shm().deny_ptrace);
  EXPECT_TRUE(o.verify_checksums);
  EXPECT_EQ(o.rdma().devices, (std::vector<std::string>{"mlx5_0", "mlx5_1"}));
  EXPECT_EQ(o.rdma().gid_index, 3);
  EXPECT_EQ(o.rdma().qps_per_peer, 9);
  EXPECT_EQ(o.rdma().send_queue_depth, 512);
  // The full name wins over the older KVWIRE_RDMA_QPS.
  ScopedEnv full({{"KVWIRE_RDMA_QPS_PER_PEER", "5"}});
  got = EngineOptions::FromEnvironment(EngineOptions());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->rdma().qps_per_peer, 5);
}

TEST(EngineOptionsTest, FromEnvironmentLeavesUnsetAndEmptyVariables) {
  EngineOptions base;
  base.listen_address = "127.0.0.1:1111";
  base.transport = "shm";
  base.tcp().connections = 3;
  base.shared_secret = "kept";
  base.rdma().gid_index = 1;
  ScopedEnv env({{"KVWIRE_LISTEN", ""},
                 {"KVWIRE_TRANSPORT", ""},
                 {"KVWIRE_TCP_CONNECTIONS", ""},
                 {"KVWIRE_SECRET", ""},
                 {"KVWIRE_SHM_CMA", ""},
                 {"KVWIRE_RDMA_GID_INDEX", ""}});
  absl::StatusOr<EngineOptions> o = EngineOptions::FromEnvironment(base);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->listen_address, "127.0.0.1:1111");
  EXPECT_EQ(o->transport, "shm");
  EXPECT_EQ(o->tcp().connections, 3);
  EXPECT_EQ(o->shared_secret, "kept");
  EXPECT_FALSE(o->shm().cma);
  EXPECT_EQ(o->rdma().gid_index, 1);
}

// A bad value fails the call, naming the variable (and, for a value out of range, the option
// and its range, as Engine::Create would).
TEST(EngineOptionsTest, FromEnvironmentRefusesBadValuesNamingTheVariable) {
  const struct {
    const char* name;
    const char* value;
    const char* error;
  } cases[] = {
      {"KVWIRE_TCP_CONNECTIONS", "65",
       "KVWIRE_TCP_CONNECTIONS=65: tcp.connections: 65 is out of range (1..64)"},
      {"KVWIRE_TCP_CONNECTIONS", "many",
       "KVWIRE_TCP_CONNECTIONS=many: tcp.connections: \"many\" is not an integer"},
      {"KVWIRE_TCP_IO_POLL", "1s",
       "KVWIRE_TCP_IO_POLL=1s: tcp.io_poll: 1s is out of range (0..10ms)"},
      {"KVWIRE_TCP_IO_POLL", "20", "KVWIRE_TCP_IO_POLL=20: tcp.io_poll: \"20\" is not a duration"},
      {"KVWIRE_SHM_CMA", "yes", "KVWIRE_SHM_CMA=yes: shm.cma: \"yes\" is not a boolean"},
      {"KVWIRE_RDMA_GID_INDEX", "1024",
       "KVWIRE_RDMA_GID_INDEX=1024: rdma.gid_index: 1024 is out of range (-1..1023)"},
      {"KVWIRE_RDMA_QPS", "0", "KVWIRE_RDMA_QPS=0: rdma.qps_per_peer: 0 is out of range (1..64)"},
      {"KVWIRE_LOG_LEVEL", "loud", "KVWIRE_LOG_LEVEL=loud: not a log level"},
  };
  for (const auto& c : cases) {
    ScopedEnv env({{c.name, c.value}});
    absl::StatusOr<EngineOptions> o = EngineOptions::FromEnvironment(EngineOptions());
    ASSERT_FALSE(o.ok()) << c.name << "=" << c.value;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(o.status().message().substr(0, std::string_view(c.error).size()), c.error)
        << o.status();
  }
  // Options of two variables that cannot be combined: the second one named.
  ScopedEnv both({{"KVWIRE_SHM_CMA", "1"}, {"KVWIRE_SHM_DENY_PTRACE", "1"}});
  absl::StatusOr<EngineOptions> o = EngineOptions::FromEnvironment(EngineOptions());
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message(),
            "KVWIRE_SHM_DENY_PTRACE=1: shm.cma and shm.deny_ptrace cannot be combined");
  // A transport's name is Engine::Create's to check (an outside transport may have it).
  ScopedEnv name({{"KVWIRE_SHM_CMA", ""},
                  {"KVWIRE_SHM_DENY_PTRACE", ""},
                  {"KVWIRE_TRANSPORT", "carrier-pigeon"}});
  o = EngineOptions::FromEnvironment(EngineOptions());
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(Engine::Create(*o).status().message(),
            "transport: unknown transport \"carrier-pigeon\" (expected auto, rdma, shm, tcp)");
}

std::unique_ptr<Engine> MakeEngine(const std::string& name, const std::string& transport = "auto") {
  EngineOptions options;
  options.name = name;
  options.transport = transport;
  auto engine = Engine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

bool Lists(const absl::StatusOr<std::vector<RemoteRegion>>& regions, RegionId id) {
  if (!regions.ok()) return false;
  return std::any_of(regions->begin(), regions->end(),
                     [id](const RemoteRegion& r) { return r.id == id; });
}

// The dialer exports exactly ConnectOptions::exports during the handshake; Export adds more
// later; a region never exported stays unreachable.
TEST(EngineApiTest, ConnectExportsOnlyTheListedRegionsAndExportAddsMore) {
  // Region memory outlives both engines (declared first): TSan sees the engines' threads
  // joined, not the sockets that order their last access before the free.
  std::vector<std::byte> first(8192), second(8192);
  std::vector<std::byte> local(8192, std::byte{0xEE});
  auto a = MakeEngine("api-a", "tcp");
  auto b = MakeEngine("api-b", "tcp");
  ASSERT_TRUE(a && b);
  FillPattern(first.data(), first.size(), 21, 0);
  FillPattern(second.data(), second.size(), 21, 1);
  auto r1 = a->RegisterMemory(first.data(), first.size());
  auto r2 = a->RegisterMemory(second.data(), second.size());
  ASSERT_TRUE(r1.ok() && r2.ok());
  ConnectOptions connect;
  connect.exports = {*r1};
  auto to_b = a->Connect(b->address(), connect);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  auto to_a = b->WaitForPeer("api-a", absl::Seconds(10));
  ASSERT_TRUE(to_a.ok()) << to_a.status();
  ASSERT_TRUE(b->WaitForRemoteRegion(*to_a, *r1, absl::Seconds(10)).ok());
  EXPECT_FALSE(Lists(b->RemoteRegions(*to_a), *r2));

  auto l = b->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(l.ok());
  auto read = [&](RegionId remote) -> absl::Status {
    auto id = b->Transfer(*to_a, OpKind::kRead, {Op{*l, 0, remote, 0, 8192}});
    if (!id.ok()) return id.status();
    return b->Wait(*id, absl::Seconds(30));
  };
  const absl::Status refused = read(*r2);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find(absl::StrCat(*r2)), std::string::npos) << refused;
  EXPECT_TRUE(
      std::all_of(local.begin(), local.end(), [](std::byte x) { return x == std::byte{0xEE}; }));
  ASSERT_TRUE(read(*r1).ok());
  EXPECT_EQ(FirstDifference(local.data(), first.data(), 8192), -1);

  ASSERT_TRUE(a->Export(*to_b, {*r2}).ok());
  ASSERT_TRUE(b->WaitForRemoteRegion(*to_a, *r2, absl::Seconds(10)).ok());
  ASSERT_TRUE(read(*r2).ok());
  EXPECT_EQ(FirstDifference(local.data(), second.data(), 8192), -1);
  // Export of a region this engine does not have is refused.
  EXPECT_FALSE(a->Export(*to_b, {*r2 + 1000}).ok());
}

// One-op transfers of one pair reuse what the transfers before them chose (the route, the
// region just used): a deregistration, an unexport and a re-export between two transfers are
// each seen by the next one, over shm (the transport of the engine's fast path).
TEST(EngineApiTest, RepeatedTransfersSeeEachChangeMadeBetweenThem) {
  absl::StatusOr<ShareableBuffer> target = ShareableBuffer::Create(8192, "api-target");
  absl::StatusOr<ShareableBuffer> one = ShareableBuffer::Create(8192, "api-one");
  absl::StatusOr<ShareableBuffer> two = ShareableBuffer::Create(8192, "api-two");
  ASSERT_TRUE(target.ok() && one.ok() && two.ok());
  auto a = MakeEngine("fast-a", "shm");
  auto b = MakeEngine("fast-b", "shm");
  ASSERT_TRUE(a && b);
  auto rb = b->RegisterMemory(target->data(), target->size());
  auto l1 = a->RegisterMemory(one->data(), one->size());
  auto l2 = a->RegisterMemory(two->data(), two->size());
  ASSERT_TRUE(rb.ok() && l1.ok() && l2.ok());
  auto to_b = a->Connect(b->address());
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  auto to_a = b->WaitForPeer("fast-a", absl::Seconds(10));
  ASSERT_TRUE(to_a.ok()) << to_a.status();
  ASSERT_TRUE(b->Export(*to_a, {*rb}).ok());
  ASSERT_TRUE(a->WaitForRemoteRegion(*to_b, *rb, absl::Seconds(10)).ok());
  auto write = [&](RegionId local, uint64_t offset) -> absl::Status {
    auto id = a->Transfer(*to_b, OpKind::kWrite, {Op{local, offset, *rb, offset, 4096}});
    if (!id.ok()) return id.status();
    return a->Wait(*id, absl::Seconds(30));
  };
  std::memset(one->data(), 0x11, 4096);
  ASSERT_TRUE(write(*l1, 0).ok());
  ASSERT_TRUE(write(*l1, 0).ok());
  EXPECT_EQ(target->data()[4095], std::byte{0x11});

  // Unexported by the target: refused once the initiator has heard of it (the message is
  // asynchronous), and the target's memory keeps what it had.
  ASSERT_TRUE(b->Unexport(*to_a, {*rb}).ok());
  for (const absl::Time until = absl::Now() + absl::Seconds(10);
       Lists(a->RemoteRegions(*to_b), *rb) && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_FALSE(Lists(a->RemoteRegions(*to_b), *rb));
  std::memset(one->data(), 0x22, 4096);
  const absl::Status unexported = write(*l1, 0);
  EXPECT_EQ(unexported.code(), absl::StatusCode::kNotFound) << unexported;
  EXPECT_EQ(target->data()[0], std::byte{0x11});

  // Exported again: reachable again.
  ASSERT_TRUE(b->Export(*to_a, {*rb}).ok());
  ASSERT_TRUE(a->WaitForRemoteRegion(*to_b, *rb, absl::Seconds(10)).ok());
  ASSERT_TRUE(write(*l1, 0).ok());
  EXPECT_EQ(target->data()[0], std::byte{0x22});

  // The local region of the last transfers deregistered: the next one naming it is refused,
  // one from another region goes through.
  ASSERT_TRUE(a->DeregisterMemory(*l1).ok());
  const absl::Status deregistered = write(*l1, 0);
  EXPECT_EQ(deregistered.code(), absl::StatusCode::kNotFound) << deregistered;
  std::memset(two->data() + 4096, 0x33, 4096);
  ASSERT_TRUE(write(*l2, 4096).ok());
  EXPECT_EQ(target->data()[4096], std::byte{0x33});
  EXPECT_EQ(target->data()[0], std::byte{0x22});
}

// One-op shm transfers end inside Transfer and are kept outside the transfer table
// (src/core/inline_ends.h, a ring of 64): reported once each by Wait or Poll, in any order,
// also when far more are left unwaited than the ring holds (the rest go to the table); an
// expired deadline still fails one; Stats counts each.
TEST(EngineApiTest, InlineEndedTransfersAreReportedOnceEachHoweverManyWait) {
  constexpr int kTransfers = 200;  // > InlineEnds::kSlots
  absl::StatusOr<ShareableBuffer> target = ShareableBuffer::Create(kTransfers * 64, "ring-tgt");
  absl::StatusOr<ShareableBuffer> source = ShareableBuffer::Create(kTransfers * 64, "ring-src");
  ASSERT_TRUE(target.ok() && source.ok());
  auto a = MakeEngine("ring-a", "shm");
  auto b = MakeEngine("ring-b", "shm");
  ASSERT_TRUE(a && b);
  auto rb = b->RegisterMemory(target->data(), target->size());
  auto la = a->RegisterMemory(source->data(), source->size());
  ASSERT_TRUE(rb.ok() && la.ok());
  auto to_b = a->Connect(b->address());
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  auto to_a = b->WaitForPeer("ring-a", absl::Seconds(10));
  ASSERT_TRUE(to_a.ok()) << to_a.status();
  ASSERT_TRUE(b->Export(*to_a, {*rb}).ok());
  ASSERT_TRUE(a->WaitForRemoteRegion(*to_b, *rb, absl::Seconds(10)).ok());
  const uint64_t succeeded_before = a->Stats().transfers_succeeded;
  std::vector<TransferId> ids;
  for (int i = 0; i < kTransfers; ++i) {
    std::memset(source->data() + i * 64, i + 1, 64);
    auto id = a->Transfer(*to_b, OpKind::kWrite, {Op{*la, i * 64ull, *rb, i * 64ull, 64}});
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    EXPECT_EQ(target->data()[i * 64 + 63], std::byte(i + 1)) << i;  // ended before the id
  }
  // Every end is counted before its id is out, waited for or not.
  EXPECT_EQ(a->Stats().transfers_succeeded - succeeded_before, kTransfers);
  // The newest first (in the ring or the table, whichever took it), every third by Poll.
  for (int i = kTransfers - 1; i >= 0; --i) {
    if (i % 3 == 0) {
      absl::Status status = absl::UnknownError("not set");
      EXPECT_EQ(a->Poll(ids[i], &status), TransferState::kSucceeded) << i;
      EXPECT_TRUE(status.ok()) << i << ": " << status;
    } else {
      EXPECT_TRUE(a->Wait(ids[i], absl::Seconds(10)).ok()) << i;
    }
  }
  // Reported once: then forgotten, wherever it was kept.
  for (int i : {0, 1, kTransfers / 2, kTransfers - 1}) {
    EXPECT_EQ(a->Wait(ids[i], absl::Seconds(1)).code(), absl::StatusCode::kNotFound) << i;
    EXPECT_EQ(a->Poll(ids[i], nullptr), TransferState::kFailed) << i;
  }
  // A deadline that passed while the copy ran fails the transfer as the deadline thread would.
  TransferOptions expired;
  expired.timeout = absl::ZeroDuration();
  auto late = a->Transfer(*to_b, OpKind::kWrite, {Op{*la, 0, *rb, 0, 64}}, expired);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(a->Wait(*late, absl::Seconds(10)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(a->Stats().transfers_failed, 1u);
}

// ConnectOptions::transport overrides the engine's choice for that peer, and says so.
TEST(EngineApiTest, ConnectTransportOverridesTheEngineDefault) {
  auto a = MakeEngine("api-dialer");  // auto: shm on this host unless told otherwise
  auto b = MakeEngine("api-tcp-peer");
  auto c = MakeEngine("api-shm-peer");
  ASSERT_TRUE(a && b && c);
  ConnectOptions tcp;
  tcp.transport = "tcp";
  auto to_b = a->Connect(b->address(), tcp);
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  auto to_c = a->Connect(c->address());
  ASSERT_TRUE(to_c.ok()) << to_c.status();
  for (const PeerStats& p : a->Stats().peers) {
    if (p.peer_id == *to_b) {
      EXPECT_EQ(p.transport.rfind("tcp x", 0), 0u) << p.transport;
      EXPECT_EQ(p.transport_reason, "forced by configuration");
    } else if (p.peer_id == *to_c) {
      EXPECT_EQ(p.transport.rfind("shm memfd", 0), 0u) << p.transport;
      EXPECT_EQ(p.transport_reason, "same host");
    } else {
      ADD_FAILURE() << "unexpected peer " << p.name;
    }
  }
}

// FindPeer names live peers only.
TEST(EngineApiTest, FindPeerFindsLivePeersByName) {
  auto a = MakeEngine("api-finder");
  auto b = MakeEngine("api-found");
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->FindPeer("api-found").status().code(), absl::StatusCode::kNotFound);
  auto id = a->Connect(b->address());
  ASSERT_TRUE(id.ok()) << id.status();
  auto found = a->FindPeer("api-found");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, *id);
  EXPECT_EQ(a->FindPeer("nobody").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(a->Disconnect(*id).ok());
  EXPECT_EQ(a->FindPeer("api-found").status().code(), absl::StatusCode::kNotFound);
}

// Poll: pending while the peer cannot answer, the final state once, then the transfer is
// forgotten (NotFound).
TEST(EngineApiTest, PollReportsPendingThenTheFinalStateOnce) {
  auto peer = PeerProcess::Start(
      {"--transport=tcp", "--regions=1", "--region_bytes=1048576", "--seed=4", "--name=polled"});
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto engine = MakeEngine("poller", "tcp");
  ASSERT_TRUE(engine);
  std::vector<std::byte> local(1 << 20, std::byte{0xEE});
  auto l = engine->RegisterMemory(local.data(), local.size());
  ASSERT_TRUE(l.ok());
  auto p = engine->Connect((*peer)->address());
  ASSERT_TRUE(p.ok()) << p.status();
  const RegionId remote = (*peer)->regions()[0];
  ASSERT_TRUE(engine->WaitForRemoteRegion(*p, remote, absl::Seconds(10)).ok());
  ASSERT_TRUE((*peer)->Freeze().ok());
  auto id = engine->Transfer(*p, OpKind::kRead, {Op{*l, 0, remote, 0, 1 << 20}});
  ASSERT_TRUE(id.ok()) << id.status();
  absl::Status status = absl::UnknownError("not set");
  EXPECT_EQ(engine->Poll(*id, &status), TransferState::kPending);  // the peer is stopped
  (*peer)->Signal(SIGCONT);
  TransferState state = TransferState::kPending;
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       state == TransferState::kPending && absl::Now() < until;) {
    state = engine->Poll(*id, &status);
    if (state == TransferState::kPending) absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(state, TransferState::kSucceeded) << status;
  EXPECT_TRUE(status.ok()) << status;
  for (uint64_t i = 0; i < local.size(); ++i) ASSERT_EQ(local[i], PatternByte(4, 0, i)) << i;
  EXPECT_EQ(engine->Poll(*id, &status), TransferState::kFailed);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;

  // A failed transfer is reported as failed, with its status: the peer stopped again, the
  // transfer's deadline passes.
  ASSERT_TRUE((*peer)->Freeze().ok());
  TransferOptions short_deadline;
  short_deadline.timeout = absl::Milliseconds(200);
  auto bad = engine->Transfer(*p, OpKind::kRead, {Op{*l, 0, remote, 0, 1 << 20}}, short_deadline);
  ASSERT_TRUE(bad.ok()) << bad.status();
  state = TransferState::kPending;
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       state == TransferState::kPending && absl::Now() < until;) {
    state = engine->Poll(*bad, &status);
    if (state == TransferState::kPending) absl::SleepFor(absl::Milliseconds(1));
  }
  (*peer)->Signal(SIGCONT);
  EXPECT_EQ(state, TransferState::kFailed);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  (*peer)->Stop();
}

// TakeNotifications: each notification once, after its data, naming the sender.
TEST(EngineApiTest, TakeNotificationsDeliversEachOnceAfterItsData) {
  // Region memory outlives both engines (see above).
  std::vector<std::byte> target(1 << 20, std::byte{0});
  std::vector<std::byte> source(1 << 20);
  auto a = MakeEngine("api-writer", "tcp");
  auto b = MakeEngine("api-target", "tcp");
  ASSERT_TRUE(a && b);
  RegionOptions exported;
  exported.export_to_all_peers = true;
  auto t = b->RegisterMemory(target.data(), target.size(), exported);
  ASSERT_TRUE(t.ok());
  FillPattern(source.data(), source.size(), 8, 0);
  auto s = a->RegisterMemory(source.data(), source.size());
  ASSERT_TRUE(s.ok());
  auto to_b = a->Connect(b->address());
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  ASSERT_TRUE(a->WaitForRemoteRegion(*to_b, *t, absl::Seconds(10)).ok());
  EXPECT_TRUE(b->TakeNotifications().empty());
  std::vector<TransferId> ids;
  for (int i = 0; i < 3; ++i) {
    TransferOptions options;
    options.notification = absl::StrCat("note-", i);
    const uint64_t offset = i * (256 << 10);
    auto id = a->Transfer(*to_b, OpKind::kWrite, {Op{*s, offset, *t, offset, 256 << 10}}, options);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(a->Wait(*id, absl::Seconds(30)).ok());
    ids.push_back(*id);
  }
  std::vector<Notification> got;
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       got.size() < 3 && absl::Now() < until;) {
    std::vector<Notification> more = b->TakeNotifications();
    got.insert(got.end(), more.begin(), more.end());
    if (got.size() < 3) absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(got.size(), 3u);
  std::sort(got.begin(), got.end(),
            [](const Notification& x, const Notification& y) { return x.payload < y.payload; });
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i].payload, absl::StrCat("note-", i));
    EXPECT_EQ(got[i].peer_name, "api-writer");
    EXPECT_EQ(got[i].transfer_id, ids[i]);
  }
  // The data of all three is there (the last notification came after the last byte).
  EXPECT_EQ(FirstDifference(target.data(), source.data(), 3 * (256 << 10)), -1);
  EXPECT_TRUE(b->TakeNotifications().empty());  // each once
}

}  // namespace
}  // namespace kvwire::testing
