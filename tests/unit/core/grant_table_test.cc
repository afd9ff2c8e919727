// GrantTable and CheckIncoming, without an engine: which ranges a grant covers (merged, never
// across a gap), of which region, for which peer, and the access check that applies them.
#include "src/core/grant_table.h"

#include <random>
#include <set>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/container/flat_hash_set.h"

namespace kvwire::core {
namespace {

constexpr PeerId kPeer = 5;
constexpr RegionId kA = 1;
constexpr RegionId kB = 2;

bool Covers(const GrantTable& t, PeerId peer, GrantId g, RegionId region, uint64_t offset,
            uint64_t length) {
  return t.Check(peer, g, region, offset, length).ok();
}

TEST(GrantTableTest, CoversItsRangesAndNothingBetweenThem) {
  GrantTable t;
  const GrantRange ranges[] = {{kA, 0, 10}, {kA, 20, 10}};
  const GrantId g = t.Add(kPeer, ranges);
  EXPECT_TRUE(Covers(t, kPeer, g, kA, 0, 10));
  EXPECT_TRUE(Covers(t, kPeer, g, kA, 22, 8));
  EXPECT_FALSE(Covers(t, kPeer, g, kA, 10, 10)) << "the gap";
  EXPECT_FALSE(Covers(t, kPeer, g, kA, 5, 20)) << "straddles the gap";
  EXPECT_FALSE(Covers(t, kPeer, g, kA, 25, 10)) << "runs past the end";
  // The same offsets of another region, another peer, another grant id.
  EXPECT_FALSE(Covers(t, kPeer, g, kB, 0, 10));
  EXPECT_FALSE(Covers(t, kPeer + 1, g, kA, 0, 10));
  EXPECT_FALSE(Covers(t, kPeer, g + 1, kA, 0, 10));
  EXPECT_FALSE(Covers(t, kPeer, 0, kA, 0, 10)) << "no grant presented";
}

TEST(GrantTableTest, TouchingAndOverlappingRangesMerge) {
  GrantTable t;
  const GrantRange ranges[] = {{kA, 10, 10}, {kA, 0, 10}, {kA, 15, 10}, {kB, 100, 1}};
  const GrantId g = t.Add(kPeer, ranges);
  EXPECT_TRUE(Covers(t, kPeer, g, kA, 0, 25)) << "[0,10) [10,20) [15,25) are one range";
  EXPECT_FALSE(Covers(t, kPeer, g, kA, 0, 26));
  EXPECT_TRUE(Covers(t, kPeer, g, kB, 100, 1));
  EXPECT_FALSE(Covers(t, kPeer, g, kB, 99, 2));
}

TEST(GrantTableTest, RemovedAndForgottenGrantsCoverNothing) {
  GrantTable t;
  const GrantRange ranges[] = {{kA, 0, 64}};
  const GrantId g1 = t.Add(kPeer, ranges);
  const GrantId g2 = t.Add(kPeer, ranges);
  const GrantId other = t.Add(kPeer + 1, ranges);
  EXPECT_NE(g1, g2);
  EXPECT_EQ(t.live(), 3u);
  EXPECT_EQ(t.Remove(kPeer + 1, g1).code(), absl::StatusCode::kNotFound) << "not its grant";
  ASSERT_TRUE(t.Remove(kPeer, g1).ok());
  EXPECT_FALSE(Covers(t, kPeer, g1, kA, 0, 64));
  EXPECT_TRUE(Covers(t, kPeer, g2, kA, 0, 64));
  EXPECT_EQ(t.Remove(kPeer, g1).code(), absl::StatusCode::kNotFound) << "twice";
  t.ForgetPeer(kPeer);
  EXPECT_FALSE(Covers(t, kPeer, g2, kA, 0, 64));
  EXPECT_TRUE(Covers(t, kPeer + 1, other, kA, 0, 64)) << "another peer's grants stay";
  EXPECT_EQ(t.live(), 1u);
}

// The access check: bounds and permission first, then the grant, only for READs of guarded
// regions; *grant_refused tells which refused.
TEST(CheckIncomingTest, GrantsApplyToReadsOfGuardedRegionsOnly) {
  std::vector<std::byte> guarded_mem(4096), open_mem(4096);
  RegionRegistry regions;
  transport::LocalRegion guarded;
  guarded.base = guarded_mem.data();
  guarded.length = guarded_mem.size();
  guarded.access = kRemoteReadWrite;
  guarded.reads_need_grant = true;
  transport::LocalRegion open = guarded;
  open.base = open_mem.data();
  open.reads_need_grant = false;
  const RegionId g_id = regions.Add(guarded, /*export_to_all=*/true);
  const RegionId o_id = regions.Add(open, /*export_to_all=*/true);
  GrantTable grants;
  const GrantRange ranges[] = {{g_id, 1024, 1024}};
  const GrantId g = grants.Add(kPeer, ranges);

  bool grant_refused = true;
  auto r = CheckIncoming(regions, grants, kPeer, g_id, 1024, 512, OpKind::kRead, g, &grant_refused);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(grant_refused);
  EXPECT_EQ(r->data, guarded_mem.data() + 1024);

  r = CheckIncoming(regions, grants, kPeer, g_id, 0, 512, OpKind::kRead, g, &grant_refused);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(grant_refused);
  r = CheckIncoming(regions, grants, kPeer, g_id, 1024, 512, OpKind::kRead, 0, &grant_refused);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(grant_refused);

  // Out of bounds is the registry's refusal, not the grant's.
  r = CheckIncoming(regions, grants, kPeer, g_id, 4000, 512, OpKind::kRead, g, &grant_refused);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_FALSE(grant_refused);
  // WRITEs and unguarded regions need no grant.
  EXPECT_TRUE(
      CheckIncoming(regions, grants, kPeer, g_id, 0, 512, OpKind::kWrite, 0, &grant_refused).ok());
  EXPECT_TRUE(
      CheckIncoming(regions, grants, kPeer, o_id, 0, 512, OpKind::kRead, 0, &grant_refused).ok());
  EXPECT_FALSE(grant_refused);
}

// Against a model that keeps every granted byte: random ranges of three regions, in order,
// shuffled and overlapping, with empty ones; every check of a random range (touching each
// range's ends and gaps) says what the model says. Catches a merge that spans a gap or crosses
// regions, and a lookup that picks the wrong span.
TEST(GrantTableTest, CoversExactlyTheBytesOfItsRangesWhateverTheirOrder) {
  std::mt19937_64 rng(42);
  for (int round = 0; round < 200; ++round) {
    std::vector<GrantRange> ranges;
    std::set<std::pair<RegionId, uint64_t>> granted;  // (region, byte)
    const int n = 1 + static_cast<int>(rng() % 40);
    uint64_t next = 0;
    for (int i = 0; i < n; ++i) {
      GrantRange r;
      // Half sorted by region then offset, as a request grants (the sort is skipped), half
      // anywhere.
      r.region = round % 2 == 0 ? 1 + static_cast<RegionId>(i * 3 / n) : 1 + rng() % 3;
      if (i > 0 && round % 2 == 0 && r.region != ranges.back().region) next = rng() % 8;
      r.offset = round % 2 == 0 ? (next += rng() % 24) : rng() % 512;
      r.length = rng() % 8 == 0 ? 0 : 1 + rng() % 32;
      for (uint64_t b = r.offset; b < r.offset + r.length; ++b) granted.insert({r.region, b});
      ranges.push_back(r);
    }
    GrantTable t;
    const GrantId g = t.Add(kPeer, ranges);
    for (int probe = 0; probe < 300; ++probe) {
      const RegionId region = 1 + rng() % 3;
      const GrantRange& near = ranges[rng() % ranges.size()];
      uint64_t offset = probe % 2 == 0 ? near.offset + rng() % (near.length + 2) : rng() % 600;
      offset = offset >= 1 && rng() % 4 == 0 ? offset - 1 : offset;
      const uint64_t length = 1 + rng() % 40;
      bool model = true;
      for (uint64_t b = offset; b < offset + length && model; ++b) {
        model = granted.contains({region, b});
      }
      ASSERT_EQ(Covers(t, kPeer, g, region, offset, length), model)
          << "round " << round << ": region " << region << " [" << offset << ", " << offset + length
          << ")";
    }
  }
}

// A run of ops checked together (a served copy's slot) is refused where the op-by-op check
// first refuses, for the same reason, and resolves the ops before it to the same memory:
// random runs over a guarded, an open, an unexported, a write-only and an unknown region,
// with ops in and out of the grant and the regions' bounds, empty ones, READs and WRITEs,
// with the grant, none, or a wrong one. Catches a run whose bounds-only path skips its bounds,
// a grant check that stops at the wrong op, and a run that forgets to check the grant.
TEST(CheckIncomingRunTest, RefusesWhereTheOpByOpCheckRefusesForTheSameReason) {
  constexpr uint64_t kLength = 4096;
  std::vector<std::byte> mem(4 * kLength);
  RegionRegistry regions;
  transport::LocalRegion region;
  region.length = kLength;
  region.access = kRemoteReadWrite;
  region.base = mem.data();
  region.reads_need_grant = true;
  const RegionId guarded = regions.Add(region, /*export_to_all=*/true);
  region.base = mem.data() + kLength;
  region.reads_need_grant = false;
  const RegionId open = regions.Add(region, /*export_to_all=*/true);
  region.base = mem.data() + 2 * kLength;
  const RegionId unexported = regions.Add(region, /*export_to_all=*/false);
  region.base = mem.data() + 3 * kLength;
  region.access = kRemoteWrite;
  const RegionId write_only = regions.Add(region, /*export_to_all=*/true);
  const RegionId unknown = 99;
  GrantTable grants;
  std::vector<GrantRange> granted;
  for (uint64_t offset = 0; offset < kLength; offset += 1024)
    granted.push_back({guarded, offset, 512});
  const GrantId g = grants.Add(kPeer, granted);

  std::mt19937_64 rng(7);
  int refused_by_grant = 0, refused_otherwise = 0, passed_whole = 0;
  for (int round = 0; round < 3000; ++round) {
    const OpKind kind = rng() % 4 == 0 ? OpKind::kWrite : OpKind::kRead;
    const GrantId presented = rng() % 8 == 0 ? 0 : rng() % 8 == 0 ? g + 1 : g;
    std::vector<transport::IncomingOp> ops(1 + rng() % 24);
    for (transport::IncomingOp& op : ops) {
      const uint64_t pick = rng() % 100;
      op.region = pick < 55   ? guarded
                  : pick < 90 ? open
                  : pick < 94 ? unexported
                  : pick < 97 ? write_only
                              : unknown;
      // Mostly inside a granted range (1024 k + [0, 512)), sometimes anywhere or past the end.
      const uint64_t base = 1024 * (rng() % 4);
      op.offset = rng() % 16 == 0 ? rng() % (kLength + 64) : base + rng() % 384;
      op.length = rng() % 32 == 0 ? 0 : rng() % 16 == 0 ? rng() % 2048 : 1 + rng() % 128;
    }
    std::vector<transport::IncomingMemory> memory(ops.size());
    const CheckedRun run =
        CheckIncomingRun(regions, grants, kPeer, ops, kind, presented, absl::MakeSpan(memory));
    size_t expected_passed = ops.size();
    bool reads_need_grant = false;
    for (size_t i = 0; i < ops.size(); ++i) {
      bool grant_refused = false;
      absl::StatusOr<ResolvedRange> one =
          CheckIncoming(regions, grants, kPeer, ops[i].region, ops[i].offset, ops[i].length, kind,
                        presented, &grant_refused);
      if (!one.ok()) {
        expected_passed = i;
        ASSERT_EQ(run.passed, i) << "round " << round << ": " << one.status();
        EXPECT_EQ(run.refused, one.status()) << "round " << round;
        EXPECT_EQ(run.grant_refused, grant_refused) << "round " << round;
        (grant_refused ? refused_by_grant : refused_otherwise)++;
        break;
      }
      ASSERT_LT(i, run.passed) << "round " << round << ": op " << i << " passes alone";
      EXPECT_EQ(memory[i].data, one->data) << "round " << round << ": op " << i;
      reads_need_grant = reads_need_grant || (kind == OpKind::kRead && one->reads_need_grant);
    }
    if (expected_passed == ops.size()) {
      ASSERT_EQ(run.passed, ops.size()) << "round " << round;
      EXPECT_TRUE(run.refused.ok()) << run.refused;
      ++passed_whole;
    }
    EXPECT_EQ(run.first_guarded < run.passed, reads_need_grant) << "round " << round;
    EXPECT_FALSE(run.pins.empty() && run.passed > 0) << "round " << round;
  }
  // Every outcome was drawn, often.
  EXPECT_GT(refused_by_grant, 200);
  EXPECT_GT(refused_otherwise, 200);
  EXPECT_GT(passed_whole, 200);
}

// The epoch tcp's read runs hold to (tcp_read_run.h) moves with every way access ends, and
// not with what grants it.
TEST(AccessEpochTest, ChangesWhenAccessIsTakenBackOnly) {
  std::vector<std::byte> mem(8192);
  RegionRegistry regions;
  GrantTable grants;
  transport::LocalRegion region;
  region.base = mem.data();
  region.length = 4096;
  region.access = kRemoteReadWrite;
  auto epoch = [&] { return regions.access_epoch() + grants.access_epoch(); };
  const uint64_t start = epoch();
  const RegionId a = regions.Add(region, /*export_to_all=*/false);
  region.base = mem.data() + 4096;
  const RegionId b = regions.Add(region, /*export_to_all=*/true);
  ASSERT_TRUE(regions.ExportTo(kPeer, {a}).ok());
  const GrantRange ranges[] = {{a, 0, 64}};
  const GrantId g1 = grants.Add(kPeer, ranges);
  const GrantId g2 = grants.Add(kPeer, ranges);
  EXPECT_EQ(epoch(), start) << "registering, exporting and granting take nothing back";
  uint64_t last = epoch();
  auto changed = [&] {
    const bool moved = epoch() != last;
    last = epoch();
    return moved;
  };
  ASSERT_TRUE(grants.Remove(kPeer, g1).ok());
  EXPECT_TRUE(changed()) << "grant revoked";
  grants.ForgetPeer(kPeer);
  EXPECT_TRUE(changed()) << "grants of a closed peer";
  (void)g2;
  ASSERT_TRUE(regions.UnexportFrom(kPeer, {a}).ok());
  EXPECT_TRUE(changed()) << "unexported";
  regions.ForgetPeer(kPeer);
  EXPECT_TRUE(changed()) << "peer forgotten";
  RegionRegistry::Move move = regions.BeginMove(mem.data(), 4096);
  EXPECT_TRUE(changed()) << "about to move";
  move.overlapping.clear();
  regions.EndMove(move.id);
  ASSERT_TRUE(regions.Remove(b).ok());
  EXPECT_TRUE(changed()) << "deregistered";
}

// A peer learns a grant's id only from the read_ok that carries it; ids that follow each other
// would let it name the next one (e.g. one made while its request ended, revoked right after).
TEST(GrantTableTest, IdsAreUnpredictableDistinctAndNeverZero) {
  GrantTable t;
  const GrantRange ranges[] = {{kA, 0, 10}};
  absl::flat_hash_set<GrantId> seen;
  GrantId previous = t.Add(kPeer, ranges);
  seen.insert(previous);
  int consecutive = 0;
  for (int i = 0; i < 1000; ++i) {
    const GrantId g = t.Add(kPeer, ranges);
    EXPECT_NE(g, 0u);
    EXPECT_TRUE(seen.insert(g).second) << "grant id " << g << " given twice";
    if (g == previous + 1) ++consecutive;
    previous = g;
  }
  EXPECT_EQ(consecutive, 0) << "grant ids follow each other";
}

}  // namespace
}  // namespace kvwire::core
