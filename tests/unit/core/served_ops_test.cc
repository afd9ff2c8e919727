#include "src/core/served_ops.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

#include "src/core/grant_table.h"
#include "src/util/block_pool.h"

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

// A pin per served op, thousands per request: their memory is reused, not allocated per op
// (the pool of src/util/block_pool.h). And a pin that outlives every other holder of its
// ServedOps (the pin's release destroys it) still frees into a live pool (ASan checks it).
TEST(ServedOpsTest, PinsReuseTheirMemoryAndOutliveTheirOwner) {
  auto ops = std::make_shared<ServedOps>();
  std::vector<std::shared_ptr<const void>> pins;
  for (int i = 0; i < 64; ++i) pins.push_back(ops->Begin(1, nullptr));
  EXPECT_EQ(ops->pooled_pins(), 0u);
  std::vector<const void*> first;
  for (const auto& pin : pins) first.push_back(pin.get());
  pins.clear();
  EXPECT_EQ(ops->pooled_pins(), 64u);
  for (int round = 0; round < 100; ++round) {
    for (int i = 0; i < 64; ++i) pins.push_back(ops->Begin(1, nullptr));
    ASSERT_EQ(ops->pooled_pins(), 0u) << "round " << round;
    for (const auto& pin : pins) {
      ASSERT_NE(std::find(first.begin(), first.end(), pin.get()), first.end())
          << "round " << round << ": a pin in fresh memory";
    }
    pins.clear();
    ASSERT_EQ(ops->pooled_pins(), 64u) << "round " << round;
  }
  EXPECT_EQ(ops->in_flight(), 0u);

  std::shared_ptr<const void> last = ops->Begin(2, std::make_shared<int>(1));
  ops.reset();  // the pin holds the last reference: its release destroys the ServedOps
  last.reset();
}

TEST(BlockPoolTest, KeepsAtMostItsBlocksAndOnlyOfItsSize) {
  auto pool = std::make_shared<BlockPool>(2);
  void* a = pool->Allocate(48);
  void* b = pool->Allocate(48);
  void* c = pool->Allocate(48);
  void* other = pool->Allocate(200);  // not the pool's size: operator new's
  pool->Deallocate(other, 200);
  EXPECT_EQ(pool->free_blocks(), 0u);
  pool->Deallocate(a, 48);
  pool->Deallocate(b, 48);
  pool->Deallocate(c, 48);  // beyond the two kept
  EXPECT_EQ(pool->free_blocks(), 2u);
  void* again = pool->Allocate(48);
  EXPECT_TRUE(again == a || again == b);
  pool->Deallocate(again, 48);
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

// Events instead of waits (Engine::WhenServedOps, RevokeWhenServed): nothing blocks; the
// callback runs on the thread that ends the last op waited for.
TEST(ServedOpsTest, WhenPeerServedFiresWhenTheOpsBeganBeforeItEnd) {
  auto ops = std::make_shared<ServedOps>();
  int fired = 0;
  EXPECT_TRUE(ops->WhenPeerServed(1, [&] { ++fired; }));  // none in flight: true, not called
  EXPECT_EQ(fired, 0);
  std::shared_ptr<const void> a = ops->Begin(1, nullptr);
  std::shared_ptr<const void> other = ops->Begin(2, nullptr);
  EXPECT_FALSE(ops->WhenPeerServed(1, [&] { ++fired; }));
  std::shared_ptr<const void> later = ops->Begin(1, nullptr);  // not waited for
  other.reset();
  EXPECT_EQ(fired, 0);
  a.reset();
  EXPECT_EQ(fired, 1);
  later.reset();
  EXPECT_EQ(fired, 1);  // once
}

TEST(ServedOpsTest, RevokeWhenServedWaitsForTheBytesTheReaderRead) {
  auto ops = std::make_shared<ServedOps>();
  GrantTable grants;
  const GrantId g = grants.Add(1, {{7, 0, 1 << 20}});
  int fired = 0;
  // The reader says it read 3000 bytes; 1000 were served so far, the rest still in its socket.
  std::shared_ptr<const void> first =
      ops->BeginGranted(1, g, 1000, /*required=*/true, grants, nullptr);
  ASSERT_NE(first, nullptr);
  first.reset();
  EXPECT_EQ(ops->ServedBytes(1, g), 1000u);
  EXPECT_FALSE(ops->RevokeWhenServed(1, g, 3000, grants, [&] { ++fired; }));
  EXPECT_TRUE(grants.Live(1, g));  // not revoked: the op still to come is served
  std::shared_ptr<const void> second =
      ops->BeginGranted(1, g, 2000, /*required=*/true, grants, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(fired, 0);
  second.reset();  // its last access is over: the count is reached and nothing is in flight
  EXPECT_EQ(fired, 1);
  EXPECT_FALSE(grants.Live(1, g));
  // Revoked: a later op under it is refused (a guarded region), or not counted (unguarded).
  EXPECT_EQ(ops->BeginGranted(1, g, 10, /*required=*/true, grants, nullptr), nullptr);
  EXPECT_NE(ops->BeginGranted(1, g, 10, /*required=*/false, grants, nullptr), nullptr);
  EXPECT_EQ(ops->ServedBytes(1, g), 0u);
}

TEST(ServedOpsTest, RevokeWhenServedWithoutACountRevokesNowAndWaitsForOpsInFlight) {
  auto ops = std::make_shared<ServedOps>();
  GrantTable grants;
  const GrantId g = grants.Add(1, {{7, 0, 4096}});
  const GrantId idle = grants.Add(1, {{7, 0, 4096}});
  EXPECT_TRUE(ops->RevokeWhenServed(1, idle, 0, grants, [] { FAIL() << "kept"; }));
  EXPECT_FALSE(grants.Live(1, idle));
  std::shared_ptr<const void> op = ops->BeginGranted(1, g, 4096, true, grants, nullptr);
  int fired = 0;
  EXPECT_FALSE(ops->RevokeWhenServed(1, g, 0, grants, [&] { ++fired; }));
  EXPECT_FALSE(grants.Live(1, g));  // revoked at once: nothing new begins under it
  EXPECT_EQ(ops->BeginGranted(1, g, 1, true, grants, nullptr), nullptr);
  EXPECT_EQ(fired, 0);
  op.reset();
  EXPECT_EQ(fired, 1);
}

TEST(ServedOpsTest, ALyingCountWaitsUntilTheGrantIsRevokedOtherwise) {
  auto ops = std::make_shared<ServedOps>();
  GrantTable grants;
  const GrantId g = grants.Add(1, {{7, 0, 4096}});
  const GrantId h = grants.Add(1, {{7, 0, 4096}});
  int fired = 0;
  EXPECT_FALSE(ops->RevokeWhenServed(1, g, 1 << 30, grants, [&] { ++fired; }));
  EXPECT_FALSE(ops->RevokeWhenServed(1, h, 1 << 30, grants, [&] { ++fired; }));
  EXPECT_EQ(fired, 0);
  // The holder gives up (its deadline): a revocation ends the wait for bytes.
  EXPECT_TRUE(ops->Revoke(1, g, grants).ok());
  EXPECT_EQ(fired, 1);
  // So does the peer's close.
  ops->ForgetPeer(1, grants);
  EXPECT_EQ(fired, 2);
  EXPECT_FALSE(grants.Live(1, h));
  EXPECT_EQ(ops->Revoke(1, g, grants).code(), absl::StatusCode::kNotFound);
}

// The connector revokes some grants without waiting for their end (a grant made for a request
// already gone, a deadline's forced revocation): an op still served under one must settle it
// when it ends, with no `done` to call (calling an empty std::function would throw on the
// thread that served the op).
TEST(ServedOpsTest, ARevocationNobodyWaitsForSettlesWhenItsOpEnds) {
  auto ops = std::make_shared<ServedOps>();
  GrantTable grants;
  const GrantId g = grants.Add(1, {{7, 0, 4096}});
  std::shared_ptr<const void> op = ops->BeginGranted(1, g, 64, true, grants, nullptr);
  ASSERT_NE(op, nullptr);
  int fired = 0;
  EXPECT_FALSE(ops->RevokeWhenServed(1, g, 1 << 30, grants, [&] { ++fired; }));
  EXPECT_FALSE(ops->RevokeWhenServed(1, g, 0, grants, nullptr));
  EXPECT_FALSE(grants.Live(1, g));
  EXPECT_EQ(fired, 0);
  op.reset();  // ends the op on this thread: the empty watch is dropped, the other fires
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(ops->in_flight(), 0u);
  EXPECT_EQ(ops->BeginGranted(1, g, 64, true, grants, nullptr), nullptr);
}

// The revocation and an op's begin are ordered by the same lock: an op either is counted
// before the grant goes (and waited for) or is refused after; never served unseen.
TEST(ServedOpsTest, AnOpRacingTheRevocationIsWaitedForOrRefused) {
  for (int round = 0; round < 200; ++round) {
    auto ops = std::make_shared<ServedOps>();
    GrantTable grants;
    const GrantId g = grants.Add(1, {{7, 0, 4096}});
    std::atomic<bool> freed{false};
    std::atomic<int> late{0};
    std::thread server([&] {
      std::shared_ptr<const void> pin = ops->BeginGranted(1, g, 64, true, grants, nullptr);
      if (pin != nullptr && freed.load()) ++late;  // served after the blocks went
    });
    if (ops->RevokeWhenServed(1, g, 0, grants, [&] { freed = true; })) freed = true;
    server.join();
    EXPECT_EQ(late.load(), 0);
    EXPECT_TRUE(freed.load());
  }
}

}  // namespace
}  // namespace kvwire::core
