#include "src/util/recent_set.h"

#include <cstdint>

#include <gtest/gtest.h>

namespace kvwire {
namespace {

TEST(RecentSetTest, RemembersOnlyTheMostRecentInsertions) {
  RecentSet<uint64_t> set(3);
  EXPECT_TRUE(set.Insert(1));
  EXPECT_FALSE(set.Insert(1)) << "a second insertion of the same value is not new";
  EXPECT_TRUE(set.Insert(2));
  EXPECT_TRUE(set.Insert(3));
  EXPECT_TRUE(set.Insert(4));  // forgets 1, the oldest
  EXPECT_EQ(set.size(), 3u);
  EXPECT_FALSE(set.Contains(1));
  EXPECT_TRUE(set.Contains(2) && set.Contains(3) && set.Contains(4));
}

// One mark per closed peer, forever, is what the bound replaces: a long-lived process that
// sees many peers come and go stays at the capacity.
TEST(RecentSetTest, StaysBoundedAcrossManyClosedPeers) {
  RecentSet<uint64_t> set(kClosedPeersRemembered);
  constexpr uint64_t kPeers = 10 * kClosedPeersRemembered;
  for (uint64_t peer = 1; peer <= kPeers; ++peer) ASSERT_TRUE(set.Insert(peer));
  EXPECT_EQ(set.size(), kClosedPeersRemembered);
  EXPECT_TRUE(set.Contains(kPeers));
  EXPECT_TRUE(set.Contains(kPeers - kClosedPeersRemembered + 1));
  EXPECT_FALSE(set.Contains(kPeers - kClosedPeersRemembered));
}

TEST(RecentSetTest, ZeroCapacityKeepsOne) {
  RecentSet<uint64_t> set(0);
  EXPECT_EQ(set.capacity(), 1u);
  EXPECT_TRUE(set.Insert(5));
  EXPECT_TRUE(set.Contains(5));
  EXPECT_TRUE(set.Insert(6));
  EXPECT_FALSE(set.Contains(5));
}

}  // namespace
}  // namespace kvwire
