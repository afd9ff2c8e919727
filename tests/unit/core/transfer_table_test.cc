#include "src/core/transfer_table.h"

#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

#include "src/util/mutex.h"

namespace kvwire::core {
namespace {

TransferInfo Info(TransferId id, absl::Duration timeout = absl::Seconds(30)) {
  TransferInfo info;
  info.id = id;
  info.peer = 9;
  info.start = absl::Now();
  info.deadline = info.start + timeout;
  return info;
}

TEST(TransferTableTest, SucceedsWhenAllLanesSucceed) {
  TransferTable table;
  table.Start(Info(1), 3);
  EXPECT_FALSE(table.LaneDone(1, absl::OkStatus()).has_value());
  EXPECT_FALSE(table.LaneDone(1, absl::OkStatus()).has_value());
  EXPECT_EQ(table.Poll(1, nullptr), TransferState::kPending);
  auto done = table.LaneDone(1, absl::OkStatus());
  ASSERT_TRUE(done.has_value());
  EXPECT_TRUE(done->status.ok());
  EXPECT_TRUE(table.Finish(1, done->status));
  absl::Status s;
  EXPECT_EQ(table.Poll(1, &s), TransferState::kSucceeded);
  // Reported once, then forgotten.
  EXPECT_EQ(table.Poll(1, &s), TransferState::kFailed);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
}

TEST(TransferTableTest, FirstErrorWins) {
  TransferTable table;
  table.Start(Info(2), 3);
  table.LaneDone(2, absl::DataLossError("first"));
  table.LaneDone(2, absl::InternalError("second"));
  auto done = table.LaneDone(2, absl::OkStatus());
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->status.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(table.Finish(2, done->status));
  EXPECT_FALSE(table.Finish(2, absl::OkStatus()));  // never overwritten
  EXPECT_EQ(table.Wait(2, absl::Seconds(1)).code(), absl::StatusCode::kDataLoss);
}

// The completing thread claims the end, accounts for the transfer, then ends it: meanwhile
// the transfer is still pending to Poll, and neither its deadline nor a peer's death can end
// it (the bytes did move); the status CompleteEnd gives is the one reported.
TEST(TransferTableTest, ClaimedEndIsOnlyEndedByItsClaimant) {
  TransferTable table;
  table.Start(Info(4, absl::Milliseconds(1)), 1);
  ASSERT_TRUE(table.LaneDone(4, absl::OkStatus()).has_value());
  ASSERT_TRUE(table.ClaimEnd(4));
  EXPECT_FALSE(table.ClaimEnd(4));
  EXPECT_TRUE(table.ExpireDeadlines(absl::Now() + absl::Seconds(1)).empty());
  EXPECT_TRUE(table
                  .FailIf([](const TransferInfo&) { return true; },
                          [](const TransferInfo&) { return absl::UnavailableError("peer died"); })
                  .empty());
  EXPECT_EQ(table.Poll(4, nullptr), TransferState::kPending);
  EXPECT_EQ(table.pending(), 1u);
  table.CompleteEnd(4, absl::OkStatus());
  EXPECT_FALSE(table.Finish(4, absl::InternalError("late")));
  EXPECT_TRUE(table.Wait(4, absl::Seconds(1)).ok());
}

TEST(TransferTableTest, DeadlineEndsTransferAndLateLanesAreIgnored) {
  TransferTable table;
  auto cancelled = table.Start(Info(3, absl::Milliseconds(1)), 2);
  // The clock is an argument: a time past the 1 ms deadline, no sleep needed.
  auto expired = table.ExpireDeadlines(absl::Now() + absl::Seconds(1));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_TRUE(cancelled->load());
  absl::Status s = table.Wait(3, absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("transfer 3"), std::string::npos) << s;
  EXPECT_FALSE(table.LaneDone(3, absl::OkStatus()).has_value());
  EXPECT_FALSE(table.LaneDone(3, absl::OkStatus()).has_value());
  EXPECT_EQ(table.pending(), 0u);
}

TEST(TransferTableTest, WaitTimesOutWithoutEndingTheTransfer) {
  TransferTable table;
  table.Start(Info(4), 1);
  EXPECT_EQ(table.Wait(4, absl::Milliseconds(20)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(table.Poll(4, nullptr), TransferState::kPending);
}

TEST(TransferTableTest, WaitWakesWhenAnotherThreadFinishes) {
  TransferTable table;
  table.Start(Info(5), 1);
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(20));
    auto done = table.LaneDone(5, absl::OkStatus());
    table.Finish(5, done->status);
  });
  EXPECT_TRUE(table.Wait(5, absl::Seconds(10)).ok());
  t.join();
}

// Engine::Transfer's inline end: one step ends a one-lane transfer; Wait then reports it.
// A transfer a deadline or a peer's death ended first is not ended again (its ender
// accounted for it) and keeps that status.
TEST(TransferTableTest, EndInlineEndsOnceAndFirstEndWins) {
  TransferTable table;
  table.Start(Info(20), 1);
  absl::Status lane = absl::DataLossError("lane");
  EXPECT_TRUE(table.EndInline(20, &lane, absl::Now()));
  EXPECT_EQ(lane.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(table.pending(), 0u);
  EXPECT_EQ(table.Wait(20, absl::Seconds(1)).code(), absl::StatusCode::kDataLoss);

  table.Start(Info(21), 1);
  auto failed = table.FailIf([](const TransferInfo&) { return true; },
                             [](const TransferInfo&) { return absl::UnavailableError("closed"); });
  EXPECT_EQ(failed.size(), 1u);
  absl::Status ok;
  EXPECT_FALSE(table.EndInline(21, &ok, absl::Now()));
  EXPECT_EQ(table.Wait(21, absl::Seconds(1)).code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(table.EndInline(99, &ok, absl::Now()));  // unknown
  EXPECT_TRUE(ok.ok());
}

// Engine::Transfer's end of a transfer kept out of the table, when its InlineEnds slot is
// taken: added as ended, reported once by Wait or Poll, never pending, never expired.
TEST(TransferTableTest, AddEndedIsReportedOnceAndNeverPending) {
  TransferTable table;
  table.AddEnded(Info(40, absl::ZeroDuration()), absl::DataLossError("copy"));
  table.AddEnded(Info(41), absl::OkStatus());
  EXPECT_EQ(table.pending(), 0u);
  EXPECT_TRUE(table.ExpireDeadlines(absl::Now() + absl::Hours(1)).empty());
  EXPECT_EQ(table.Wait(40, absl::Seconds(1)).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(table.Wait(40, absl::Seconds(1)).code(), absl::StatusCode::kNotFound);
  absl::Status status = absl::UnknownError("not set");
  EXPECT_EQ(table.Poll(41, &status), TransferState::kSucceeded);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(table.Poll(41, &status), TransferState::kFailed);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
}

// A transfer started without its deadline watched (Engine::Transfer's may-end-inline case):
// the deadline thread does not expire it, and EndInline ends it as the deadline would have
// when the deadline had passed by the end; ArmDeadline watches it from then on, unless it
// ended already.
TEST(TransferTableTest, UnarmedDeadlineIsCheckedByEndInlineOrArmedLater) {
  TransferTable table;
  table.Start(Info(30, absl::Milliseconds(1)), 1, nullptr, /*arm_deadline=*/false);
  const absl::Time later = absl::Now() + absl::Seconds(1);
  EXPECT_TRUE(table.ExpireDeadlines(later).empty());
  absl::Status status;  // the lane's: OK
  EXPECT_TRUE(table.EndInline(30, &status, later));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(table.Wait(30, absl::Seconds(1)).code(), absl::StatusCode::kDeadlineExceeded);

  // Ended in time: its status stands.
  table.Start(Info(31), 1, nullptr, /*arm_deadline=*/false);
  absl::Status in_time;
  EXPECT_TRUE(table.EndInline(31, &in_time, absl::Now()));
  EXPECT_TRUE(in_time.ok());
  EXPECT_TRUE(table.Wait(31, absl::Seconds(1)).ok());

  // Not ended inline: armed after the post, it expires as any other.
  table.Start(Info(32, absl::Milliseconds(1)), 1, nullptr, /*arm_deadline=*/false);
  table.ArmDeadline(32);
  table.ArmDeadline(32);  // once is enough: no second entry
  std::vector<TransferInfo> expired = table.ExpireDeadlines(later);
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].id, 32u);
  EXPECT_TRUE(table.ExpireDeadlines(later).empty());
  EXPECT_EQ(table.Wait(32, absl::Seconds(1)).code(), absl::StatusCode::kDeadlineExceeded);

  // Ended before it was armed: nothing left to watch (the deadline thread would otherwise wake
  // for it forever).
  table.Start(Info(33, absl::Milliseconds(1)), 1, nullptr, /*arm_deadline=*/false);
  ASSERT_TRUE(table.LaneDone(33, absl::OkStatus()).has_value());
  EXPECT_TRUE(table.Finish(33, absl::OkStatus()));
  table.ArmDeadline(33);
  EXPECT_TRUE(table.ExpireDeadlines(later).empty());
  EXPECT_TRUE(table.Wait(33, absl::Seconds(1)).ok());
  // Nothing pending, nothing to wake for: WaitForDeadline sleeps to its limit.
  EXPECT_TRUE(table.WaitForDeadline(absl::Now() + absl::Milliseconds(1)));
}

// A polling Wait (EngineOptions::wait_poll) sees an end made by another thread during its poll,
// sleeps as usual once the poll is spent, and still honours its own timeout.
TEST(TransferTableTest, PollingWaitSeesEndsAndKeepsItsTimeout) {
  TransferTable table;
  table.Start(Info(22), 1);
  table.Start(Info(23), 1);
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(2));
    table.Finish(23, absl::OkStatus());  // another transfer's end: the waiter looks again
    absl::SleepFor(absl::Milliseconds(2));
    table.Finish(22, absl::OkStatus());
  });
  EXPECT_TRUE(table.Wait(22, absl::Seconds(10), absl::Seconds(5)).ok());
  t.join();
  EXPECT_TRUE(table.Wait(23, absl::Seconds(1), absl::Milliseconds(1)).ok());

  // Ended after the poll is spent: the waiter is asleep by then and woken.
  table.Start(Info(24), 1);
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(30));
    table.Finish(24, absl::OkStatus());
  });
  EXPECT_TRUE(table.Wait(24, absl::Seconds(10), absl::Microseconds(50)).ok());
  late.join();

  // A poll longer than the timeout ends at the timeout.
  table.Start(Info(25), 1);
  const absl::Time start = absl::Now();
  EXPECT_EQ(table.Wait(25, absl::Milliseconds(20), absl::Seconds(5)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  EXPECT_EQ(table.Poll(25, nullptr), TransferState::kPending);
}

TEST(TransferTableTest, FailIfFailsOnlyMatching) {
  TransferTable table;
  TransferInfo a = Info(6);
  a.peer = 1;
  TransferInfo b = Info(7);
  b.peer = 2;
  table.Start(a, 1);
  table.Start(b, 1);
  auto failed = table.FailIf([](const TransferInfo& i) { return i.peer == 1; },
                             [](const TransferInfo&) { return absl::UnavailableError("dead"); });
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].id, 6u);
  EXPECT_EQ(table.Poll(7, nullptr), TransferState::kPending);
  EXPECT_EQ(table.Wait(6, absl::Seconds(1)).code(), absl::StatusCode::kUnavailable);
}

// Completion is pushed: an ended transfer's callback runs once on the thread that runs
// RunEndCallbacks (not the thread that ended it), with the final status; the record is then
// forgotten (the callback had the status).
TEST(TransferTableTest, EndCallbackRunsOnceOnTheCompletionThread) {
  TransferTable table;
  std::thread::id completion_thread;
  std::thread completer([&] {
    completion_thread = std::this_thread::get_id();
    table.RunEndCallbacks();
  });
  Mutex mu;
  CondVar cv;
  std::vector<std::pair<TransferId, absl::Status>> ends;
  std::vector<std::thread::id> threads;
  auto on_end = [&](TransferId id, const absl::Status& s) {
    MutexLock lock(&mu);
    ends.emplace_back(id, s);
    threads.push_back(std::this_thread::get_id());
    cv.SignalAll();
  };
  table.Start(Info(20), 1, on_end);
  table.Start(Info(21), 2, on_end);
  ASSERT_TRUE(table.LaneDone(20, absl::OkStatus()).has_value());
  ASSERT_TRUE(table.ClaimEnd(20));
  table.CompleteEnd(20, absl::OkStatus());
  // Both lanes of 21 fail; the first error wins and is reported once, however it ends.
  EXPECT_FALSE(table.LaneDone(21, absl::DataLossError("lane 0")).has_value());
  auto done = table.LaneDone(21, absl::InternalError("lane 1"));
  ASSERT_TRUE(done.has_value());
  EXPECT_TRUE(table.Finish(21, done->status));
  EXPECT_FALSE(table.Finish(21, absl::OkStatus()));
  EXPECT_TRUE(table
                  .FailIf([](const TransferInfo&) { return true; },
                          [](const TransferInfo&) { return absl::CancelledError("late"); })
                  .empty());
  {
    MutexLock lock(&mu);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (ends.size() < 2 && absl::Now() < deadline) cv.WaitUntil(&mu, deadline);
  }
  table.StopEndCallbacks();
  completer.join();
  ASSERT_EQ(ends.size(), 2u);
  EXPECT_EQ(ends[0].first, 20u);
  EXPECT_TRUE(ends[0].second.ok());
  EXPECT_EQ(ends[1].first, 21u);
  EXPECT_EQ(ends[1].second.code(), absl::StatusCode::kDataLoss);
  for (const std::thread::id& t : threads) EXPECT_EQ(t, completion_thread);
  EXPECT_EQ(table.pending(), 0u);
  absl::Status s;
  EXPECT_EQ(table.Poll(20, &s), TransferState::kFailed);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
}

// A deadline wakes the deadline thread when it falls due: a transfer started after the thread
// went to sleep with a far limit still expires (its earlier deadline woke the sleeper), and
// its callback reports DeadlineExceeded. Stopping ends the wait at once.
TEST(TransferTableTest, DeadlineWaitWakesForAnEarlierDeadline) {
  TransferTable table;
  std::thread completer([&] { table.RunEndCallbacks(); });
  Mutex mu;
  CondVar cv;
  std::optional<absl::Status> end;
  std::vector<TransferInfo> expired;
  std::thread reaper([&] {
    // A limit far past the test's own deadlines: only the transfer's deadline can wake it.
    while (table.WaitForDeadline(absl::Now() + absl::Hours(1))) {
      std::vector<TransferInfo> now = table.ExpireDeadlines(absl::Now());
      MutexLock lock(&mu);
      expired.insert(expired.end(), now.begin(), now.end());
    }
  });
  absl::SleepFor(absl::Milliseconds(20));  // let the reaper sleep on an empty table
  table.Start(Info(30, absl::Milliseconds(50)), 1, [&](TransferId, const absl::Status& s) {
    MutexLock lock(&mu);
    end = s;
    cv.SignalAll();
  });
  {
    MutexLock lock(&mu);
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (!end && absl::Now() < deadline) cv.WaitUntil(&mu, deadline);
  }
  table.StopDeadlineWaits();
  reaper.join();
  table.StopEndCallbacks();
  completer.join();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].id, 30u);
  // Its lane finishing later changes nothing.
  EXPECT_FALSE(table.LaneDone(30, absl::OkStatus()).has_value());
}

// Every callback queued before the stop runs before RunEndCallbacks returns.
TEST(TransferTableTest, StopDeliversQueuedCallbacksFirst) {
  TransferTable table;
  int calls = 0;  // only the completer thread touches it until join
  for (TransferId id = 40; id < 50; ++id) {
    table.Start(Info(id), 1, [&calls](TransferId, const absl::Status&) { ++calls; });
  }
  EXPECT_EQ(table
                .FailIf([](const TransferInfo&) { return true; },
                        [](const TransferInfo&) { return absl::CancelledError("stop"); })
                .size(),
            10u);
  table.StopEndCallbacks();
  std::thread completer([&] { table.RunEndCallbacks(); });
  completer.join();
  EXPECT_EQ(calls, 10);
}

}  // namespace
}  // namespace kvwire::core
