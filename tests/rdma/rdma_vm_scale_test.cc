// Many rdma peers on one soft-RoCE device, inside the VM (tests/rdma/vm/): a hub engine with a
// QP budget (RdmaOptions::max_qps_per_device) takes peers until the budget is spent;
// the next peer is refused with an error naming the budget and the option, never a crash;
// the peers inside the budget all READ and WRITE the hub at once, byte-exact; and a peer that
// leaves frees its QPs for the next.
//
// Size: KVWIRE_VM_SCALE_PEERS (default 24) peer engines in this process, one QP each, on rxe0.
// rxe itself allows far more QPs (max_qp 1048560 on 6.1) than one CQ can serve: the hub's CQ
// (32767 entries on rxe) holds about 60 target QPs of 513 entries, and a peer past that is
// refused the same way ("completion queue of rxe0:1 is full").
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"

namespace kvwire::testing {
namespace {

constexpr uint64_t kSlot = 16 << 10;

EngineOptions ScaleOptions(const std::string& name) {
  EngineOptions o;
  o.name = name;
  o.transport = "rdma";
  o.rdma().devices = {"rxe0"};
  o.rdma().qps_per_peer = 1;
  o.rdma().send_queue_depth = 16;
  o.connect_timeout = absl::Seconds(60);
  // Slow heartbeats: dozens of engines in one emulated VM.
  o.heartbeat_interval = absl::Seconds(5);
  o.peer_lease = absl::Seconds(60);
  return o;
}

uint8_t Byte(uint64_t slot, uint64_t i, uint64_t area) {
  return static_cast<uint8_t>((slot * 131 + i * 7 + area * 59) & 0xff);
}

TEST(RdmaVmScaleTest, QpBudgetRefusesThePeerBeyondItAndTheOthersWork) {
  uint64_t peers = 24;
  if (const char* v = std::getenv("KVWIRE_VM_SCALE_PEERS")) {
    ASSERT_TRUE(absl::SimpleAtoi(v, &peers) && peers > 1) << v;
  }
  // Each peer costs the hub one initiator and one target QP on rxe0.
  EngineOptions hub_options = ScaleOptions("hub");
  hub_options.rdma().max_qps_per_device = static_cast<int>(2 * peers);
  auto created = Engine::Create(hub_options);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> hub = std::move(*created);
  // Area A (slot s): the peers WRITE it; area B: they READ it.
  std::vector<uint8_t> region(2 * peers * kSlot);
  for (uint64_t s = 0; s < peers; ++s) {
    for (uint64_t i = 0; i < kSlot; ++i) region[(peers + s) * kSlot + i] = Byte(s, i, 1);
  }
  RegionOptions exported;
  exported.export_to_all_peers = true;
  auto hub_region = hub->RegisterMemory(region.data(), region.size(), exported);
  ASSERT_TRUE(hub_region.ok()) << hub_region.status();

  struct Peer {
    std::unique_ptr<Engine> engine;
    std::vector<uint8_t> buffer = std::vector<uint8_t>(2 * kSlot);
    RegionId local = 0;
    PeerId hub = 0;
  };
  const auto make_peer = [&](const std::string& name) {
    Peer p;
    auto e = Engine::Create(ScaleOptions(name));
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return p;
    p.engine = std::move(*e);
    auto id = p.engine->RegisterMemory(p.buffer.data(), p.buffer.size());
    EXPECT_TRUE(id.ok()) << id.status();
    p.local = id.ok() ? *id : 0;
    return p;
  };
  std::vector<Peer> all;
  const absl::Time start = absl::Now();
  for (uint64_t s = 0; s < peers; ++s) {
    all.push_back(make_peer(absl::StrCat("p", s)));
    ASSERT_TRUE(all.back().engine);
    auto id = all.back().engine->Connect(hub->address());
    ASSERT_TRUE(id.ok()) << "peer " << s << " of " << peers << ": " << id.status();
    all.back().hub = *id;
  }
  std::printf("%lu peers connected in %.1f s (QP budget %d on rxe0)\n",
              static_cast<unsigned long>(peers), absl::ToDoubleSeconds(absl::Now() - start),
              hub_options.rdma().max_qps_per_device);

  // One more: refused with the budget named; nothing crashes.
  Peer extra = make_peer("extra");
  ASSERT_TRUE(extra.engine);
  auto refused = extra.engine->Connect(hub->address());
  ASSERT_FALSE(refused.ok()) << "a peer beyond the QP budget was let in";
  std::printf("peer %lu refused: %s\n", static_cast<unsigned long>(peers + 1),
              refused.status().ToString().c_str());
  // Named in the dialer's error, or (when the hub ran out on its own QPs to the newcomer
  // first) in the reason the hub closed it with.
  std::string hub_reason;
  for (const PeerInfo& p : hub->Peers()) {
    if (!p.alive && p.name == "extra") hub_reason = p.close_reason;
  }
  const std::string named = std::string(refused.status().message()) + " | " + hub_reason;
  EXPECT_NE(named.find("QP budget"), std::string::npos) << named;
  EXPECT_NE(named.find("rdma.max_qps_per_device"), std::string::npos) << named;
  // The dialer's own error names the budget too: when the hub refused on its own QPs first
  // and closed, the dialer's QP exchange in flight ends with the hub's Goodbye reason rather
  // than waiting out its deadline ("no reply on the control channel", issue 25).
  // Either side may refuse first (a race), so a few more tries.
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (attempt > 0) refused = extra.engine->Connect(hub->address());
    ASSERT_FALSE(refused.ok()) << "a peer beyond the QP budget was let in";
    const std::string dialer(refused.status().message());
    EXPECT_NE(dialer.find("QP budget"), std::string::npos) << attempt << ": " << dialer;
    EXPECT_NE(dialer.find("rdma.max_qps_per_device"), std::string::npos) << dialer;
    EXPECT_EQ(dialer.find("no reply on the control channel"), std::string::npos) << dialer;
  }

  // Everyone inside the budget at once: WRITE area A, READ area B.
  std::vector<std::pair<size_t, TransferId>> ids;
  for (size_t s = 0; s < all.size(); ++s) {
    Peer& p = all[s];
    ASSERT_TRUE(p.engine->WaitForRemoteRegion(p.hub, *hub_region, absl::Seconds(60)).ok());
    for (uint64_t i = 0; i < kSlot; ++i) p.buffer[i] = Byte(s, i, 0);
    auto w =
        p.engine->Transfer(p.hub, OpKind::kWrite, {Op{p.local, 0, *hub_region, s * kSlot, kSlot}});
    auto r = p.engine->Transfer(p.hub, OpKind::kRead,
                                {Op{p.local, kSlot, *hub_region, (peers + s) * kSlot, kSlot}});
    ASSERT_TRUE(w.ok() && r.ok()) << w.status() << " " << r.status();
    ids.push_back({s, *w});
    ids.push_back({s, *r});
  }
  for (const auto& [s, id] : ids) {
    EXPECT_TRUE(all[s].engine->Wait(id, absl::Seconds(120)).ok()) << "peer " << s;
  }
  for (size_t s = 0; s < all.size(); ++s) {
    for (uint64_t i = 0; i < kSlot; ++i) {
      ASSERT_EQ(region[s * kSlot + i], Byte(s, i, 0)) << "area A slot " << s << " byte " << i;
      ASSERT_EQ(all[s].buffer[kSlot + i], Byte(s, i, 1)) << "peer " << s << " byte " << i;
    }
  }
  // A peer leaves: its QPs go back to the budget, and the refused one gets in.
  ASSERT_TRUE(all[0].engine->Disconnect(all[0].hub).ok());
  all[0].engine.reset();
  absl::StatusOr<PeerId> again = absl::UnknownError("not tried");
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    again = extra.engine->Connect(hub->address());
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(extra.engine->WaitForRemoteRegion(*again, *hub_region, absl::Seconds(60)).ok());
  auto r = extra.engine->Transfer(*again, OpKind::kRead,
                                  {Op{extra.local, 0, *hub_region, peers * kSlot, kSlot}});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(extra.engine->Wait(*r, absl::Seconds(120)).ok());
  for (uint64_t i = 0; i < kSlot; ++i) ASSERT_EQ(extra.buffer[i], Byte(0, i, 1)) << i;
}

}  // namespace
}  // namespace kvwire::testing
