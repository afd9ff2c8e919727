#include "src/core/transfer_table.h"

#include <thread>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

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

}  // namespace
}  // namespace kvwire::core
