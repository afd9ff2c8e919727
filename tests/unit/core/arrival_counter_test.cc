#include "src/core/arrival_counter.h"

#include <thread>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

namespace kvwire::core {
namespace {

Notification Note(PeerId peer, TransferId id, std::string payload) {
  Notification n;
  n.peer = peer;
  n.transfer_id = id;
  n.payload = std::move(payload);
  return n;
}

TEST(ArrivalCounterTest, NotificationWaitsForAllArrivals) {
  ArrivalCounter counter;
  counter.OnArrival(1, 10);
  counter.OnNotify(Note(1, 10, "done"), 3);
  EXPECT_TRUE(counter.TakeAll().empty());
  counter.OnArrival(1, 10);
  EXPECT_TRUE(counter.TakeAll().empty());
  counter.OnArrival(1, 10);
  auto ready = counter.TakeAll();
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].payload, "done");
  EXPECT_EQ(counter.pending_entries(), 0u);
}

TEST(ArrivalCounterTest, ArrivalsOfOtherPeersAndTransfersDoNotCount) {
  ArrivalCounter counter;
  counter.OnNotify(Note(1, 10, "x"), 1);
  counter.OnArrival(2, 10);
  counter.OnArrival(1, 11);
  EXPECT_TRUE(counter.TakeAll().empty());
  counter.OnArrival(1, 10);
  EXPECT_EQ(counter.TakeAll().size(), 1u);
}

TEST(ArrivalCounterTest, ZeroExpectedDeliversAtOnce) {
  ArrivalCounter counter;
  counter.OnNotify(Note(1, 1, "read done"), 0);
  EXPECT_EQ(counter.TakeAll().size(), 1u);
}

TEST(ArrivalCounterTest, LargeTransferIdsDoNotCollide) {
  ArrivalCounter counter;
  const TransferId big = (uint64_t{1} << 40) + 5;
  counter.OnNotify(Note(1, big, "big"), 1);
  counter.OnArrival(1, 5);  // same low 32 bits would collide in a 32-bit counter
  EXPECT_TRUE(counter.TakeAll().empty());
  counter.OnArrival(1, big);
  EXPECT_EQ(counter.TakeAll().size(), 1u);
}

TEST(ArrivalCounterTest, ConcurrentArrivalsFromManyThreads) {
  ArrivalCounter counter;
  counter.OnNotify(Note(3, 77, "all"), 4000);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) counter.OnArrival(3, 77);
    });
  }
  Notification n;
  EXPECT_TRUE(counter.WaitOne(absl::Now() + absl::Seconds(30), &n));
  for (auto& t : threads) t.join();
  EXPECT_EQ(n.payload, "all");
}

TEST(ArrivalCounterTest, DropPeerAndPrune) {
  ArrivalCounter counter;
  counter.OnNotify(Note(1, 1, "a"), 5);
  counter.OnArrival(2, 2);
  EXPECT_EQ(counter.DropPeer(1), 1u);
  EXPECT_EQ(counter.Prune(absl::Now() + absl::Hours(1), absl::Minutes(10)), 1u);
  EXPECT_EQ(counter.pending_entries(), 0u);
  Notification n;
  EXPECT_FALSE(counter.WaitOne(absl::Now() + absl::Milliseconds(10), &n));
}

}  // namespace
}  // namespace kvwire::core
