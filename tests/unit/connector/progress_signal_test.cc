// The connector's progress thread sleeps on a ProgressSignal: a transfer end or a notify from
// another thread wakes it at once (no poll period), and with nothing reported it wakes when
// its deadline passes, counted apart.
#include "src/connector/progress_signal.h"

#include <thread>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

namespace kvwire::connector_internal {
namespace {

// A deadline far beyond the test's own bound: only a push can end the wait in time.
constexpr absl::Duration kFar = absl::Hours(1);

TEST(ProgressSignalTest, TransferEndWakesTheWaiter) {
  ProgressSignal signal;
  ProgressSignal::Wakeup woke;
  std::thread waiter([&] { woke = signal.Wait(absl::Now() + kFar); });
  signal.TransferEnded(7, absl::OkStatus());
  signal.TransferEnded(8, absl::DataLossError("lane failed"));
  waiter.join();
  EXPECT_TRUE(woke.signalled);
  // Whatever the waiter had not taken yet is taken by the next wait, at once.
  if (woke.ended.size() < 2) {
    ProgressSignal::Wakeup rest = signal.Wait(absl::Now() + kFar);
    woke.ended.insert(woke.ended.end(), rest.ended.begin(), rest.ended.end());
  }
  ASSERT_EQ(woke.ended.size(), 2u);
  EXPECT_EQ(woke.ended[0].id, 7u);
  EXPECT_TRUE(woke.ended[0].status.ok());
  EXPECT_EQ(woke.ended[1].id, 8u);
  EXPECT_EQ(woke.ended[1].status.code(), absl::StatusCode::kDataLoss);
  const ProgressSignal::Counters c = signal.counters();
  EXPECT_EQ(c.transfer_ends, 2u);
  EXPECT_EQ(c.timed_wakeups, 0u);
}

TEST(ProgressSignalTest, NotifyBeforeTheWaitIsNotLost) {
  ProgressSignal signal;
  signal.Notify();
  std::thread waiter([&] {
    ProgressSignal::Wakeup w = signal.Wait(absl::Now() + kFar);
    EXPECT_TRUE(w.signalled);
    EXPECT_TRUE(w.ended.empty());
  });
  waiter.join();
  EXPECT_EQ(signal.counters().signalled_wakeups, 1u);
}

TEST(ProgressSignalTest, DeadlineEndsAQuietWait) {
  ProgressSignal signal;
  ProgressSignal::Wakeup w = signal.Wait(absl::Now() + absl::Milliseconds(5));
  EXPECT_FALSE(w.signalled);
  EXPECT_TRUE(w.ended.empty());
  const ProgressSignal::Counters c = signal.counters();
  EXPECT_EQ(c.timed_wakeups, 1u);
  EXPECT_EQ(c.signalled_wakeups, 0u);
}

}  // namespace
}  // namespace kvwire::connector_internal

namespace kvwire::connector_internal {
namespace {

// The progress loop hands each wakeup's vector back: the next ends are queued into it, so a
// transfer end allocates nothing at steady state.
TEST(ProgressSignalTest, TheSpareVectorTakesTheNextEnds) {
  ProgressSignal signal;
  std::vector<ProgressSignal::EndedTransfer> spare;
  spare.reserve(64);
  const ProgressSignal::EndedTransfer* buffer = spare.data();
  signal.TransferEnded(1, absl::OkStatus());
  ProgressSignal::Wakeup first = signal.Wait(absl::Now() + kFar, std::move(spare));
  ASSERT_EQ(first.ended.size(), 1u);
  signal.TransferEnded(2, absl::OkStatus());
  ProgressSignal::Wakeup second = signal.Wait(absl::Now() + kFar, std::move(first.ended));
  ASSERT_EQ(second.ended.size(), 1u);
  EXPECT_EQ(second.ended[0].id, 2u);
  EXPECT_EQ(second.ended.data(), buffer);
}

}  // namespace
}  // namespace kvwire::connector_internal
