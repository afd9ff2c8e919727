#include "src/core/served_ops.h"

#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

namespace kvwire::core {
namespace {

TEST(ServedOpsTest, NoOpInFlightIsServedAtOnce) {
  auto ops = std::make_shared<ServedOps>();
  EXPECT_TRUE(ops->WaitForPeer(1, absl::ZeroDuration()).ok());
  auto other = ops->Begin(2, nullptr);
  // Another peer's op is not waited for.
  EXPECT_TRUE(ops->WaitForPeer(1, absl::ZeroDuration()).ok());
  EXPECT_EQ(ops->in_flight(), 1u);
}

TEST(ServedOpsTest, AnOpInFlightIsWaitedForUntilItsPinGoes) {
  auto ops = std::make_shared<ServedOps>();
  auto inner = std::make_shared<int>(7);
  std::shared_ptr<const void> pin = ops->Begin(1, inner);
  // The memory's own pin is held as long as the op.
  EXPECT_EQ(inner.use_count(), 2);
  absl::Status s = ops->WaitForPeer(1, absl::Milliseconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("1 op(s) of peer 1"), std::string::npos) << s;
  pin.reset();
  EXPECT_EQ(inner.use_count(), 1);
  EXPECT_TRUE(ops->WaitForPeer(1, absl::ZeroDuration()).ok());
  EXPECT_EQ(ops->in_flight(), 0u);
}

TEST(ServedOpsTest, OpsThatBeginAfterTheWaitStartsAreNotWaitedFor) {
  auto ops = std::make_shared<ServedOps>();
  std::shared_ptr<const void> early = ops->Begin(1, nullptr);
  std::atomic<bool> waited{false};
  absl::Status status;
  std::thread waiter([&] {
    status = ops->WaitForPeer(1, absl::Seconds(60));
    waited = true;
  });
  // Ops keep beginning while the first is served (once the waiter has fixed what it waits
  // for): the wait ends with the first alone.
  for (const absl::Time until = absl::Now() + absl::Seconds(60);
       ops->waiters() == 0 && absl::Now() < until;) {
    std::this_thread::yield();
  }
  EXPECT_EQ(ops->waiters(), 1u);
  std::vector<std::shared_ptr<const void>> later;
  for (int i = 0; i < 3; ++i) later.push_back(ops->Begin(1, nullptr));
  EXPECT_FALSE(waited.load());
  early.reset();
  waiter.join();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(ops->in_flight(), 3u);
}

// The point of it: what the serving thread did before its op ended happens before what the
// waiter does after the wait (ThreadSanitizer checks this run: `block` is a plain int).
TEST(ServedOpsTest, TheServingThreadsAccessHappensBeforeTheWaitersReuse) {
  auto ops = std::make_shared<ServedOps>();
  int block = 1;
  std::shared_ptr<const void> pin = ops->Begin(1, nullptr);
  std::atomic<bool> began{false};
  int seen = 0;
  std::thread server([&, pin = std::move(pin)]() mutable {
    while (!began.load()) std::this_thread::yield();
    seen = block;  // the serving thread reads the block
    pin.reset();   // and ends its op
  });
  began = true;
  ASSERT_TRUE(ops->WaitForPeer(1, absl::Seconds(60)).ok());
  block = 2;  // the owner refills it
  server.join();
  EXPECT_EQ(seen, 1);
}

// The other way: a fill published before an op begins is seen whole by its serving thread,
// which learns of the op through a channel that orders nothing (a relaxed flag here, a socket
// through another process in the engine).
TEST(ServedOpsTest, APublishedFillHappensBeforeTheNextOpsAccess) {
  auto ops = std::make_shared<ServedOps>();
  int block = 1;
  std::atomic<bool> asked{false};
  int seen = 0;
  std::thread server([&] {
    while (!asked.load(std::memory_order_relaxed)) std::this_thread::yield();
    std::shared_ptr<const void> pin = ops->Begin(1, nullptr);
    seen = block;
  });
  block = 3;
  ops->Publish();
  asked.store(true, std::memory_order_relaxed);
  server.join();
  EXPECT_EQ(seen, 3);
}

}  // namespace
}  // namespace kvwire::core
