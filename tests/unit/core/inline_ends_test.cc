#include "src/core/inline_ends.h"

#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace kvwire::core {
namespace {

// Each end is taken once, by its own id only; a slot is free again after its Take.
TEST(InlineEndsTest, TakesEachEndOnceByItsIdOnly) {
  InlineEnds ends;
  ASSERT_TRUE(ends.Put(7, absl::DataLossError("copy")));
  absl::Status status;
  EXPECT_FALSE(ends.Take(8, &status));                       // another slot, empty
  EXPECT_FALSE(ends.Take(7 + InlineEnds::kSlots, &status));  // same slot, another id
  EXPECT_TRUE(status.ok());
  EXPECT_TRUE(ends.Take(7, &status));
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(ends.Take(7, &status));  // once
  ASSERT_TRUE(ends.Put(7 + InlineEnds::kSlots, absl::OkStatus()));
  EXPECT_TRUE(ends.Take(7 + InlineEnds::kSlots, nullptr));
}

// A slot holding an end nobody took refuses the next id that maps to it (the engine keeps
// that end in its transfer table) and keeps its own.
TEST(InlineEndsTest, AnOccupiedSlotRefusesAndKeepsItsEnd) {
  InlineEnds ends;
  ASSERT_TRUE(ends.Put(3, absl::OkStatus()));
  EXPECT_FALSE(ends.Put(3 + InlineEnds::kSlots, absl::CancelledError("x")));
  absl::Status status = absl::UnknownError("not set");
  EXPECT_FALSE(ends.Take(3 + InlineEnds::kSlots, &status));
  EXPECT_TRUE(ends.Take(3, &status));
  EXPECT_TRUE(status.ok()) << status;
}

// One thread puts ids in order, two take them, racing for each: every id is taken exactly
// once, with its own status (TSan checks the slot handover).
TEST(InlineEndsTest, ConcurrentTakersGetEachEndExactlyOnce) {
  constexpr TransferId kIds = 20000;
  InlineEnds ends;
  std::vector<std::atomic<int>> taken(kIds + 1);
  std::atomic<TransferId> published{0};
  std::atomic<int> wrong_status{0};
  auto taker = [&] {
    for (TransferId id = 1; id <= kIds; ++id) {
      while (published.load(std::memory_order_acquire) < id) std::this_thread::yield();
      absl::Status status;
      if (ends.Take(id, &status)) {
        taken[id].fetch_add(1);
        if (status.code() != (id % 2 ? absl::StatusCode::kOk : absl::StatusCode::kAborted)) {
          wrong_status.fetch_add(1);
        }
      }
    }
  };
  std::thread t1(taker), t2(taker);
  int refused = 0;
  for (TransferId id = 1; id <= kIds; ++id) {
    if (!ends.Put(id, id % 2 ? absl::OkStatus() : absl::AbortedError("even"))) {
      ++refused;
      taken[id].fetch_add(1);  // the engine would have kept it elsewhere
    }
    published.store(id, std::memory_order_release);
  }
  t1.join();
  t2.join();
  // Each taker tries every id once it is published, so a stored end is taken by one of them.
  for (TransferId id = 1; id <= kIds; ++id) ASSERT_EQ(taken[id].load(), 1) << id << " " << refused;
  EXPECT_EQ(wrong_status.load(), 0);
}

}  // namespace
}  // namespace kvwire::core
