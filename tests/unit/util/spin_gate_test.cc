#include "src/util/spin_gate.h"

#include <cstdint>
#include <utility>

#include <gtest/gtest.h>

namespace kvwire {
namespace {

// The gate's clocks, set by hand: the policy is tested without timing.
int64_t fake_wall = 0;
int64_t fake_cpu = 0;
int64_t FakeWall() { return fake_wall; }
int64_t FakeCpu() { return fake_cpu; }

constexpr int64_t kUs = 1'000;
constexpr int64_t kMs = 1'000'000;

class SpinGateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_wall = 1'000 * kMs;
    fake_cpu = 7 * kMs;
  }
  static SpinGate::Options Opts(int max_spinners = 1) {
    SpinGate::Options o;
    o.max_spinners = max_spinners;
    o.lost_ns = 50 * kUs;
    o.min_backoff_ns = 1 * kMs;
    o.max_backoff_ns = 8 * kMs;
    o.wasted_streak = 3;
    return o;
  }
  // The thread keeps its core for `ns`: wall and CPU time move together.
  static void Run(int64_t ns) {
    fake_wall += ns;
    fake_cpu += ns;
  }
  // The thread is off its core for `ns`: only the wall clock moves.
  static void Preempted(int64_t ns) { fake_wall += ns; }
  // One spin that loses its core: Begin, a slice lost to another thread, StillOurs false.
  static void ContendedSpin(SpinGate& gate) {
    SpinGate::Spin spin = gate.Begin();
    ASSERT_TRUE(spin);
    Run(5 * kUs);
    Preempted(3 * kMs);
    EXPECT_FALSE(spin.StillOurs()) << "3 ms off the core is contention";
  }
};

TEST_F(SpinGateTest, AQuietSpinKeepsSpinning) {
  SpinGate gate(Opts(), SpinClocks{&FakeWall, &FakeCpu});
  for (int i = 0; i < 10; ++i) {
    SpinGate::Spin spin = gate.Begin();
    ASSERT_TRUE(spin) << i;
    Run(10 * kUs);
    EXPECT_TRUE(spin.StillOurs());
    Run(10 * kUs);
    EXPECT_TRUE(spin.StillOurs());
    spin.Paid();
  }
  EXPECT_EQ(gate.backoff_ns(), 0);
  EXPECT_EQ(gate.counters().admitted, 10u);
  EXPECT_EQ(gate.counters().contended, 0u);
}

// An interrupt or a sibling thread's short turn takes the core for less than lost_ns: not
// contention. Losing more is, however it is spread over the spin.
TEST_F(SpinGateTest, OnlyALossOfLostNsIsContention) {
  SpinGate gate(Opts(), SpinClocks{&FakeWall, &FakeCpu});
  SpinGate::Spin spin = gate.Begin();
  ASSERT_TRUE(spin);
  Run(20 * kUs);
  Preempted(49 * kUs);
  EXPECT_TRUE(spin.StillOurs()) << "49 us lost, under the 50 us threshold";
  Run(20 * kUs);
  Preempted(1 * kUs);
  EXPECT_FALSE(spin.StillOurs()) << "50 us lost in all";
  EXPECT_FALSE(spin.StillOurs()) << "a contended spin stays stopped";
  EXPECT_EQ(gate.counters().contended, 1u);
}

TEST_F(SpinGateTest, ContentionRefusesSpinsUntilTheBackoffPassed) {
  SpinGate gate(Opts(), SpinClocks{&FakeWall, &FakeCpu});
  ContendedSpin(gate);
  EXPECT_EQ(gate.backoff_ns(), 1 * kMs);
  EXPECT_EQ(gate.backoff_until_ns(), fake_wall + 1 * kMs);
  // The very next spin, by this thread or another, sleeps at once.
  EXPECT_FALSE(gate.Begin());
  Run(999 * kUs);
  EXPECT_FALSE(gate.Begin());
  EXPECT_EQ(gate.counters().refused_backoff, 2u);
  Run(1 * kUs);
  EXPECT_TRUE(gate.Begin()) << "the backoff has passed: a probe spins";
}

TEST_F(SpinGateTest, BackoffDoublesUpToTheMaximumAndHalvesWhenSpinsPay) {
  SpinGate gate(Opts(), SpinClocks{&FakeWall, &FakeCpu});
  const int64_t expected[] = {1 * kMs, 2 * kMs, 4 * kMs, 8 * kMs, 8 * kMs};
  for (int64_t backoff : expected) {
    ContendedSpin(gate);
    EXPECT_EQ(gate.backoff_ns(), backoff);
    EXPECT_FALSE(gate.Begin());
    Run(backoff);
  }
  // The box is quiet again: each spin that pays halves the next backoff, down to none.
  const int64_t after_paid[] = {4 * kMs, 2 * kMs, 1 * kMs, 0};
  for (int64_t backoff : after_paid) {
    SpinGate::Spin spin = gate.Begin();
    ASSERT_TRUE(spin);
    Run(10 * kUs);
    EXPECT_TRUE(spin.StillOurs());
    spin.Paid();
    spin.End();
    EXPECT_EQ(gate.backoff_ns(), backoff);
  }
  ContendedSpin(gate);
  EXPECT_EQ(gate.backoff_ns(), 1 * kMs) << "after a full recovery the backoff starts over";
}

TEST_F(SpinGateTest, AtMostMaxSpinnersSpinAtOnce) {
  SpinGate gate(Opts(/*max_spinners=*/2), SpinClocks{&FakeWall, &FakeCpu});
  EXPECT_EQ(gate.max_spinners(), 2);
  SpinGate::Spin a = gate.Begin();
  SpinGate::Spin b = gate.Begin();
  ASSERT_TRUE(a);
  ASSERT_TRUE(b);
  EXPECT_FALSE(gate.Begin());
  EXPECT_EQ(gate.counters().refused_spinners, 1u);
  // A moved spin is still one spinner, released once.
  SpinGate::Spin moved = std::move(a);
  EXPECT_FALSE(a);
  EXPECT_FALSE(gate.Begin());
  moved.Paid();
  moved.End();
  moved.End();
  SpinGate::Spin c = gate.Begin();
  EXPECT_TRUE(c);
  EXPECT_FALSE(gate.Begin()) << "b and c spin";
  EXPECT_EQ(gate.backoff_ns(), 0) << "a full gate is not contention";
}

// Spins that keep finding nothing (the awaited work takes longer than a spin) leave the CPU
// to the threads doing it: a streak of them backs off as one contended spin.
TEST_F(SpinGateTest, AStreakOfWastedSpinsBacksOff) {
  SpinGate gate(Opts(), SpinClocks{&FakeWall, &FakeCpu});
  for (int i = 0; i < 2; ++i) {
    SpinGate::Spin spin = gate.Begin();
    ASSERT_TRUE(spin);
    Run(50 * kUs);
  }
  {
    SpinGate::Spin paid = gate.Begin();
    ASSERT_TRUE(paid);
    paid.Paid();
  }
  for (int i = 0; i < 2; ++i) {
    SpinGate::Spin spin = gate.Begin();
    ASSERT_TRUE(spin) << "a spin that paid broke the streak";
    Run(50 * kUs);
  }
  EXPECT_EQ(gate.backoff_ns(), 0);
  { SpinGate::Spin third = gate.Begin(); }
  EXPECT_EQ(gate.backoff_ns(), 1 * kMs);
  EXPECT_FALSE(gate.Begin());
  EXPECT_EQ(gate.counters().contended, 0u);
}

TEST_F(SpinGateTest, DefaultsSpinOnAtLeastOneCore) {
  EXPECT_GE(SpinGate::DefaultMaxSpinners(), 1);
  SpinGate gate;
  EXPECT_EQ(gate.max_spinners(), SpinGate::DefaultMaxSpinners());
  SpinGate::Spin spin = gate.Begin();
  EXPECT_TRUE(spin) << "a fresh gate admits a spin";
}

}  // namespace
}  // namespace kvwire
