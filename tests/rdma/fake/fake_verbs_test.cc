// The rdma transport's whole path over the fake verbs (fake_verbs.h), in every build: two
// engines in this process connect over rdma (device, PDs, MRs, the QP exchange on the control
// channel, the event thread), move bytes both ways with a notification, and the per-device QP
// budget (RdmaOptions::max_qps_per_device) refuses the peer that would pass it with an
// error naming the budget, while the peers already connected keep working and a freed slot is
// usable again. The same budget on a real device (rxe) is tested in the VM
// (tests/rdma/rdma_vm_scale_test.cc).
#include "tests/rdma/fake/fake_verbs.h"

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"

namespace kvwire {
namespace {

EngineOptions RdmaOptions(const std::string& name, int qps, int budget) {
  EngineOptions o;
  o.name = name;
  o.transport = "rdma";
  o.rdma().qps_per_peer = qps;
  o.rdma().max_qps_per_device = budget;
  o.rdma().send_queue_depth = 16;
  return o;
}

std::unique_ptr<Engine> Make(const EngineOptions& o) {
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

void Fill(std::vector<std::byte>& v, int seed) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
}

TEST(RdmaFakeVerbsTest, ReadAndWriteWithNotificationAreByteExact) {
  testing::ScopedFakeVerbs fake({.move_data = true});
  {
    auto target = Make(RdmaOptions("target", 2, 0));
    auto initiator = Make(RdmaOptions("initiator", 2, 0));
    ASSERT_TRUE(target && initiator);
    std::vector<std::byte> remote(1 << 20), local(1 << 20);
    Fill(remote, 1);
    Fill(local, 2);
    RegionOptions exported;
    exported.export_to_all_peers = true;
    auto remote_id = target->RegisterMemory(remote.data(), remote.size(), exported);
    auto local_id = initiator->RegisterMemory(local.data(), local.size());
    ASSERT_TRUE(remote_id.ok() && local_id.ok());
    auto peer = initiator->Connect(target->address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE(initiator->WaitForRemoteRegion(*peer, *remote_id, absl::Seconds(30)).ok());
    ASSERT_EQ(initiator->Peers().size(), 1u);
    EXPECT_NE(initiator->Peers()[0].transport.find("rdma"), std::string::npos)
        << initiator->Peers()[0].transport;

    // WRITE local[0, 256K) -> remote[512K, 768K) in 4 KiB ops, with a notification.
    std::vector<Op> writes;
    for (uint64_t off = 0; off < (256 << 10); off += 4096) {
      writes.push_back(Op{*local_id, off, *remote_id, (512 << 10) + off, 4096});
    }
    TransferOptions notify;
    notify.notification = "written";
    auto w = initiator->Transfer(*peer, OpKind::kWrite, writes, notify);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(initiator->Wait(*w, absl::Seconds(30)).ok());
    auto n = target->WaitNotification(absl::Seconds(30));
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(n->payload, "written");
    EXPECT_EQ(std::memcmp(remote.data() + (512 << 10), local.data(), 256 << 10), 0);

    // READ remote[0, 256K) -> local[256K, 512K).
    auto r = initiator->Transfer(*peer, OpKind::kRead,
                                 {Op{*local_id, 256 << 10, *remote_id, 0, 256 << 10}});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(initiator->Wait(*r, absl::Seconds(30)).ok());
    EXPECT_EQ(std::memcmp(local.data() + (256 << 10), remote.data(), 256 << 10), 0);
    EXPECT_GT(fake.counters().send_wrs.load(), 0u);
    EXPECT_EQ(fake.counters().missed_recvs.load(), 0u);
  }
  EXPECT_EQ(fake.counters().qps_alive.load(), 0u) << "QPs left after the engines went";
}

TEST(RdmaFakeVerbsTest, QpBudgetRefusesThePeerBeyondItAndKeepsTheOthers) {
  testing::ScopedFakeVerbs fake({.move_data = true});
  constexpr int kBudget = 8;
  {
    auto hub = Make(RdmaOptions("hub", 2, kBudget));
    ASSERT_TRUE(hub);
    std::vector<std::byte> region(64 << 10);
    Fill(region, 3);
    RegionOptions exported;
    exported.export_to_all_peers = true;
    auto region_id = hub->RegisterMemory(region.data(), region.size(), exported);
    ASSERT_TRUE(region_id.ok());

    struct Peer {
      std::unique_ptr<Engine> engine;
      PeerId hub = 0;
      std::vector<std::byte> buffer = std::vector<std::byte>(4096);
      RegionId local = 0;
    };
    std::vector<Peer> peers;
    absl::Status refused;
    // Each peer costs the hub 2 initiator and 2 target QPs: the budget holds 2 peers. A few
    // more tries than that, so that a budget that never refuses fails the test.
    for (int i = 0; i < 2 * kBudget && refused.ok(); ++i) {
      Peer p;
      p.engine = Make(RdmaOptions(absl::StrCat("p", i), 2, 0));
      ASSERT_TRUE(p.engine);
      auto local = p.engine->RegisterMemory(p.buffer.data(), p.buffer.size());
      ASSERT_TRUE(local.ok());
      p.local = *local;
      auto id = p.engine->Connect(hub->address());
      if (!id.ok()) {
        refused = id.status();
        break;
      }
      p.hub = *id;
      peers.push_back(std::move(p));
    }
    ASSERT_FALSE(refused.ok()) << "no peer refused with a budget of " << kBudget << " QPs";
    std::printf("refused after %zu peers: %s\n", peers.size(), refused.ToString().c_str());
    EXPECT_EQ(peers.size(), 2u);
    // The budget is named where the refusal happened: in the dialer's error when the hub
    // refused its QP exchange (or closed it in the middle), or, when the hub ran out setting up
    // its own QPs to the newcomer first, in the reason the hub closed that peer with (the
    // dialer may then see only its QP exchange time out: see the closing note).
    std::string hub_reason;
    for (const PeerInfo& p : hub->Peers()) {
      if (!p.alive && p.name == absl::StrCat("p", peers.size())) hub_reason = p.close_reason;
    }
    const std::string named = std::string(refused.message()) + " | " + hub_reason;
    std::printf("hub's reason: %s\n", hub_reason.c_str());
    EXPECT_NE(named.find("QP budget"), std::string::npos) << named;
    EXPECT_NE(named.find("rdma.max_qps_per_device"), std::string::npos) << named;

    // The peers inside the budget still read the hub's region byte-exact.
    const auto read_ok = [&](Peer& p) {
      if (!p.engine->WaitForRemoteRegion(p.hub, *region_id, absl::Seconds(30)).ok()) return false;
      auto t = p.engine->Transfer(p.hub, OpKind::kRead, {Op{p.local, 0, *region_id, 4096, 4096}});
      if (!t.ok() || !p.engine->Wait(*t, absl::Seconds(30)).ok()) return false;
      return std::memcmp(p.buffer.data(), region.data() + 4096, 4096) == 0;
    };
    for (Peer& p : peers) EXPECT_TRUE(read_ok(p));

    // A peer that leaves frees its QPs: the next one fits.
    ASSERT_TRUE(peers[0].engine->Disconnect(peers[0].hub).ok());
    peers[0].engine.reset();
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    Peer next;
    next.engine = Make(RdmaOptions("again", 2, 0));
    ASSERT_TRUE(next.engine);
    next.local = *next.engine->RegisterMemory(next.buffer.data(), next.buffer.size());
    absl::StatusOr<PeerId> id = absl::UnknownError("not tried");
    // The hub drops the leaving peer's QPs when it sees the channel close: retried until then.
    while (absl::Now() < deadline) {
      id = next.engine->Connect(hub->address());
      if (id.ok()) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_TRUE(id.ok()) << id.status();
    next.hub = *id;
    EXPECT_TRUE(read_ok(next));
    EXPECT_TRUE(read_ok(peers[1]));
  }
  EXPECT_EQ(fake.counters().qps_alive.load(), 0u) << "QPs left after the engines went";
}

}  // namespace
}  // namespace kvwire
