// InFlightSeqs (ServedOps' per-peer ops in flight) against a std::set doing the same, under
// random adds and out-of-order ends that wrap the ring and make it grow; and the questions
// ServedOps asks (none live below a mark, how many) on the way.
#include "src/core/in_flight_seqs.h"

#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace kvwire::core {
namespace {

size_t CountBelow(const std::set<uint64_t>& live, uint64_t mark) {
  size_t n = 0;
  for (uint64_t s : live) n += s < mark ? 1 : 0;
  return n;
}

TEST(InFlightSeqsTest, MatchesASetUnderRandomAddsAndEnds) {
  std::mt19937_64 random(7);
  InFlightSeqs seqs;
  std::set<uint64_t> model;
  std::vector<uint64_t> live;
  uint64_t next = 100;
  for (int step = 0; step < 200000; ++step) {
    // Phases that fill up (to a few hundred in flight) and phases that drain.
    const bool filling = (step / 5000) % 2 == 0;
    if (live.empty() || random() % 100 < (filling ? 60u : 35u)) {
      next += 1 + random() % 3;  // increasing, not contiguous (numbers are engine-wide)
      seqs.Add(next);
      model.insert(next);
      live.push_back(next);
    } else {
      const size_t i = random() % live.size();
      seqs.End(live[i]);
      model.erase(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(seqs.live(), model.size()) << "step " << step;
    const uint64_t mark = next - random() % 50;
    ASSERT_EQ(seqs.NoneBelow(mark), model.empty() || *model.begin() >= mark) << "step " << step;
    if (step % 97 == 0) ASSERT_EQ(seqs.CountBelow(mark), CountBelow(model, mark));
  }
}

TEST(InFlightSeqsTest, EndingWhatIsNotLiveChangesNothing) {
  InFlightSeqs seqs;
  seqs.Add(5);
  seqs.Add(9);
  seqs.End(7);  // never added
  seqs.End(5);
  seqs.End(5);  // already ended
  EXPECT_EQ(seqs.live(), 1u);
  EXPECT_FALSE(seqs.NoneBelow(10));
  EXPECT_TRUE(seqs.NoneBelow(9));
  seqs.End(9);
  EXPECT_TRUE(seqs.empty());
  EXPECT_TRUE(seqs.NoneBelow(1000));
}

// One op that never ends while a million others come and go, a few at a time: the ring
// compacts the ended ones behind it instead of growing with each (a reader that stalls one op
// must not make the serving side's memory grow with its other traffic).
TEST(InFlightSeqsTest, AStalledOpDoesNotMakeTheRingGrow) {
  InFlightSeqs seqs;
  seqs.Add(1);  // stalled
  uint64_t next = 2;
  for (int round = 0; round < 250000; ++round) {
    for (int k = 0; k < 4; ++k) seqs.Add(next + k);
    for (int k = 0; k < 4; ++k) seqs.End(next + k);
    next += 4;
  }
  EXPECT_EQ(seqs.live(), 1u);
  EXPECT_FALSE(seqs.NoneBelow(2));
  EXPECT_LE(seqs.capacity(), 16u);
  seqs.End(1);
  EXPECT_TRUE(seqs.empty());
}

}  // namespace
}  // namespace kvwire::core
