// Read grants (Engine::Grant / Revoke, RegionOptions::reads_need_grant) between real engines on
// loopback: a READ of a grant-guarded region is served only inside a live grant to the peer
// that presents it. No grant, a made-up one, another peer's, a range outside it, or a revoked
// one: refused by the target with PermissionDenied, counted in grant_refused, and no byte
// arrives. Over tcp (forced) and auto on one host (shm would map the region: it must not; the
// target copies each op itself, served_copy.h), shm forced (likewise, with tcp added for
// grant-guarded regions shm cannot serve), with and without a shared secret.
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"

namespace kvwire::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kPage = 4096;
constexpr uint64_t kRegionBytes = 16 * kPage;
constexpr absl::Duration kWait = absl::Seconds(20);

absl::Status RunOps(Engine& engine, PeerId peer, OpKind kind, const std::vector<Op>& ops,
                    GrantId grant = 0) {
  TransferOptions to;
  to.grant = grant;
  to.timeout = kWait;
  absl::StatusOr<TransferId> id = engine.Transfer(peer, kind, ops, to);
  if (!id.ok()) return id.status();
  return engine.Wait(*id, kWait + absl::Seconds(5));
}

// One reader: an engine with a local buffer, connected to the target.
struct Reader {
  std::unique_ptr<Engine> engine;
  std::vector<std::byte> local = std::vector<std::byte>(kRegionBytes, std::byte{0});
  RegionId local_id = 0;
  PeerId target = 0;     // the target, as this reader knows it
  PeerId as_target = 0;  // this reader, as the target knows it

  // Reads page `page` of the target's region into the same page here.
  absl::Status ReadPage(RegionId remote, uint64_t page, GrantId grant) {
    return RunOps(*engine, target, OpKind::kRead,
                  {Op{local_id, page * kPage, remote, page * kPage, kPage}}, grant);
  }
  bool PageIsZero(uint64_t page) const {
    for (uint64_t i = 0; i < kPage; ++i) {
      if (local[page * kPage + i] != std::byte{0}) return false;
    }
    return true;
  }
};

// transport ("tcp", "auto", "shm"), secret
class ReadGrantsTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  void SetUp() override {
    EngineOptions o;
    o.name = "grant-target";
    o.transport = transport();
    if (secret()) o.shared_secret = "grants-test-secret";
    auto t = Engine::Create(o);
    ASSERT_TRUE(t.ok()) << t.status();
    target_ = std::move(*t);
    // Shareable memory: the shm transport would map it whole if nothing stopped it.
    auto buffer = ShareableBuffer::Create(kRegionBytes, "grants");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    buffer_ = std::move(*buffer);
    for (uint64_t i = 0; i < kRegionBytes; ++i) {
      buffer_.data()[i] = static_cast<std::byte>(1 + (i / kPage) * 7 + i % 5);
    }
    RegionOptions ro;
    ro.export_to_all_peers = true;
    ro.reads_need_grant = true;
    auto id = target_->RegisterMemory(buffer_.data(), kRegionBytes, ro);
    ASSERT_TRUE(id.ok()) << id.status();
    region_ = *id;
  }

  std::string transport() const { return std::get<0>(GetParam()); }
  bool secret() const { return std::get<1>(GetParam()); }

  std::unique_ptr<Reader> Connect(const std::string& name) {
    auto r = std::make_unique<Reader>();
    EngineOptions o;
    o.name = name;
    o.transport = transport();
    if (secret()) o.shared_secret = "grants-test-secret";
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    r->engine = std::move(*e);
    auto local = r->engine->RegisterMemory(r->local.data(), r->local.size());
    EXPECT_TRUE(local.ok()) << local.status();
    if (!local.ok()) return nullptr;
    r->local_id = *local;
    auto peer = r->engine->Connect(target_->address());
    EXPECT_TRUE(peer.ok()) << peer.status();
    if (!peer.ok()) return nullptr;
    r->target = *peer;
    EXPECT_TRUE(r->engine->WaitForRemoteRegion(r->target, region_, kWait).ok());
    auto back = target_->WaitForPeer(name, kWait);
    EXPECT_TRUE(back.ok()) << back.status();
    if (!back.ok()) return nullptr;
    r->as_target = *back;
    return r;
  }

  // Whether the target holds `peer` as a live peer, waiting up to kWait for it to be `want`.
  bool WaitAlive(PeerId peer, bool want) const {
    const absl::Time deadline = absl::Now() + kWait;
    while (true) {
      bool alive = false;
      for (const PeerInfo& p : target_->Peers()) alive = alive || (p.id == peer && p.alive);
      if (alive == want || absl::Now() >= deadline) return alive;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  bool PageArrived(const Reader& r, uint64_t page) const {
    return std::memcmp(r.local.data() + page * kPage, buffer_.data() + page * kPage, kPage) == 0;
  }

  std::unique_ptr<Engine> target_;
  ShareableBuffer buffer_;
  RegionId region_ = 0;
};

TEST_P(ReadGrantsTest, ReadsOnlyInsideALiveGrantOfTheirOwn) {
  int n = 0;
  const auto fresh = [&](const std::string& who) { return Connect(absl::StrCat(who, "-", n++)); };
  // Alice's request holds pages 2..3; another request's pages (8..9) are granted to nobody.
  std::unique_ptr<Reader> alice = fresh("alice");
  ASSERT_TRUE(alice);
  std::printf("route (%s, secret %d): %s\n", transport().c_str(), secret(),
              alice->engine->Stats().peers.at(0).transport.c_str());
  auto grant = target_->Grant(alice->as_target, {GrantRange{region_, 2 * kPage, 2 * kPage}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_EQ(target_->Stats().grants_live, 1u);
  ASSERT_TRUE(alice->ReadPage(region_, 2, *grant).ok());
  ASSERT_TRUE(alice->ReadPage(region_, 3, *grant).ok());
  EXPECT_TRUE(PageArrived(*alice, 2));
  EXPECT_TRUE(PageArrived(*alice, 3));

  // Each refusal closes the peer that made it (a refused op is a protocol error, and its
  // grants end with it): every case is a new peer with a grant of its own for pages 2..3.
  struct Refusal {
    const char* what;
    uint64_t page;
    uint64_t pages;
    int grant;  // 0: none, 1: its own, 2: made up, 3: another live peer's
    const char* says;
  };
  const Refusal refusals[] = {
      {"no grant", 2, 1, 0, "presented none"},
      {"another request's blocks", 8, 1, 1, "does not cover"},
      {"straddling the end of the grant", 3, 2, 1, "does not cover"},
      {"a made-up grant id", 8, 1, 2, "not live"},
      {"another peer's grant", 2, 1, 3, "not live"},
  };
  uint64_t refused = target_->Stats().grant_refused;
  for (const Refusal& c : refusals) {
    SCOPED_TRACE(c.what);
    std::unique_ptr<Reader> r = fresh("mallory");
    ASSERT_TRUE(r);
    auto own = target_->Grant(r->as_target, {GrantRange{region_, 2 * kPage, 2 * kPage}});
    ASSERT_TRUE(own.ok()) << own.status();
    const GrantId presented = c.grant == 0   ? 0
                              : c.grant == 1 ? *own
                              : c.grant == 2 ? *own + 1000
                                             : *grant;
    const absl::Status s = RunOps(
        *r->engine, r->target, OpKind::kRead,
        {Op{r->local_id, c.page * kPage, region_, c.page * kPage, c.pages * kPage}}, presented);
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.says)) << s;
    for (uint64_t p = c.page; p < c.page + c.pages; ++p) {
      EXPECT_TRUE(r->PageIsZero(p)) << "bytes of page " << p << " arrived without a grant";
    }
    EXPECT_GT(target_->Stats().grant_refused, refused);
    refused = target_->Stats().grant_refused;
    // The refusal closed that peer, and only that one.
    EXPECT_FALSE(WaitAlive(r->as_target, false)) << "the refused peer was not closed";
    EXPECT_TRUE(WaitAlive(alice->as_target, true)) << "a refusal of another peer closed alice";
  }
  // Alice's own grant is untouched by the others' refusals.
  ASSERT_TRUE(alice->ReadPage(region_, 2, *grant).ok());

  // Released: nothing more, not even what was granted.
  ASSERT_TRUE(target_->Revoke(alice->as_target, *grant).ok());
  EXPECT_EQ(target_->Revoke(alice->as_target, *grant).code(), absl::StatusCode::kNotFound);
  std::memset(alice->local.data(), 0, alice->local.size());
  const absl::Status after = alice->ReadPage(region_, 2, *grant);
  EXPECT_FALSE(after.ok());
  EXPECT_THAT(std::string(after.message()), HasSubstr("not live")) << after;
  EXPECT_TRUE(alice->PageIsZero(2));
  EXPECT_GT(target_->Stats().grant_refused, refused);

  // WRITEs are not grant-guarded (the region allows them).
  std::unique_ptr<Reader> writer = fresh("writer");
  ASSERT_TRUE(writer);
  EXPECT_TRUE(RunOps(*writer->engine, writer->target, OpKind::kWrite,
                     {Op{writer->local_id, 0, region_, 15 * kPage, 64}})
                  .ok());
  // Every refused peer was closed, and its grants with it.
  const absl::Time deadline = absl::Now() + kWait;
  while (target_->Stats().grants_live != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(target_->Stats().grants_live, 0u);
}

TEST_P(ReadGrantsTest, GrantChecksItsArguments) {
  std::unique_ptr<Reader> alice = Connect("alice");
  ASSERT_TRUE(alice);
  EXPECT_EQ(target_->Grant(alice->as_target, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      target_->Grant(alice->as_target, {GrantRange{region_, kRegionBytes - 8, 16}}).status().code(),
      absl::StatusCode::kOutOfRange);
  EXPECT_EQ(target_->Grant(alice->as_target, {GrantRange{region_ + 99, 0, 16}}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(target_->Grant(alice->as_target + 999, {GrantRange{region_, 0, 16}}).status().code(),
            absl::StatusCode::kNotFound);
  // A bad range after good ones of the same region (whose checks after the first are bounds
  // only), or of another region, refuses the whole grant and names the range.
  absl::StatusOr<GrantId> bad = target_->Grant(
      alice->as_target,
      {GrantRange{region_, 0, 16}, GrantRange{region_, 16, 16}, GrantRange{region_, ~0ull - 4, 8}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kOutOfRange) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "range 2")) << bad.status();
  bad = target_->Grant(alice->as_target, {GrantRange{region_, 0, 16}, GrantRange{region_, 32, 16},
                                          GrantRange{region_ + 99, 0, 16}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "range 2")) << bad.status();
  EXPECT_EQ(target_->Stats().grants_live, 0u) << "a refused grant holds nothing";
  // A peer's grants end with it.
  auto grant = target_->Grant(alice->as_target, {GrantRange{region_, 0, kPage}});
  ASSERT_TRUE(grant.ok()) << grant.status();
  ASSERT_TRUE(target_->Disconnect(alice->as_target).ok());
  const absl::Time deadline = absl::Now() + kWait;
  while (target_->Stats().grants_live != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(target_->Stats().grants_live, 0u);
}

// The region is never mapped by shm (a mapping would read all of it): even a WRITE to it, which
// shm would carry if it had mapped the region, is served by the target (incoming_ops: a served
// copy over shm), not memcpy'd. With shm forced the engine connects tcp for grant-guarded regions
// shm cannot serve; in auto, tcp is the fallback for what shm cannot reach. (Forced tcp: the same
// checks hold trivially.)
TEST_P(ReadGrantsTest, ShmNeverMapsAGrantGuardedRegion) {
  std::unique_ptr<Reader> alice = Connect("alice");
  ASSERT_TRUE(alice);
  const std::string route = alice->engine->Stats().peers.at(0).transport;
  if (transport() == "shm") {
    EXPECT_THAT(route, HasSubstr("for grant-guarded regions only")) << route;
  } else if (transport() == "auto") {
    EXPECT_THAT(route, HasSubstr("for regions shm cannot reach")) << route;
  }
  const uint64_t served = target_->Stats().incoming_ops;
  ASSERT_TRUE(RunOps(*alice->engine, alice->target, OpKind::kWrite,
                     {Op{alice->local_id, 0, region_, 15 * kPage, 64}})
                  .ok());
  EXPECT_GT(target_->Stats().incoming_ops, served) << "the WRITE was not served by the target";
  EXPECT_EQ(std::memcmp(buffer_.data() + 15 * kPage, alice->local.data(), 64), 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, ReadGrantsTest,
                         ::testing::Combine(::testing::Values("tcp", "auto", "shm"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) +
                                  (std::get<1>(info.param) ? "_secret" : "_nosecret");
                         });

}  // namespace
}  // namespace kvwire::testing
