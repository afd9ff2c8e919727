#include "src/util/admission.h"

#include <gtest/gtest.h>

namespace kvwire {
namespace {

using Refusal = Admission::Refusal;

TEST(AdmissionTest, EachLimitInTurn) {
  Admission admission({.max_pending = 3, .max_pending_per_source = 2, .max_open = 10});
  EXPECT_EQ(admission.Check("a", 0), Refusal::kNone);
  admission.BeginPending("a");
  admission.BeginPending("a");
  EXPECT_EQ(admission.pending(), 2u);
  EXPECT_EQ(admission.pending_from("a"), 2u);
  // One source is held to its share; another still gets in.
  EXPECT_EQ(admission.Check("a", 2), Refusal::kPendingFromSource);
  EXPECT_EQ(admission.Check("b", 2), Refusal::kNone);
  admission.BeginPending("b");
  // The total of pending handshakes is reached: everyone waits, whatever else holds.
  EXPECT_EQ(admission.Check("c", 3), Refusal::kPending);
  EXPECT_EQ(admission.Check("a", 10), Refusal::kPending);
  admission.EndPending("a");
  EXPECT_EQ(admission.Check("c", 3), Refusal::kNone);
  // Connections past their handshake still count toward the open limit.
  EXPECT_EQ(admission.Check("c", 10), Refusal::kOpen);
}

TEST(AdmissionTest, EndingForgetsASourceAndIgnoresUnknownOnes) {
  Admission admission({.max_pending = 8, .max_pending_per_source = 1, .max_open = 8});
  admission.BeginPending("a");
  admission.EndPending("a");
  EXPECT_EQ(admission.pending(), 0u);
  EXPECT_EQ(admission.pending_from("a"), 0u);
  admission.EndPending("a");  // twice, or never begun: nothing to end
  admission.EndPending("z");
  EXPECT_EQ(admission.pending(), 0u);
  EXPECT_EQ(admission.Check("a", 0), Refusal::kNone);
}

TEST(AdmissionTest, ClearForgetsEveryPendingConnection) {
  Admission admission({.max_pending = 2, .max_pending_per_source = 2, .max_open = 8});
  admission.BeginPending("a");
  admission.BeginPending("b");
  EXPECT_EQ(admission.Check("c", 2), Refusal::kPending);
  admission.Clear();
  EXPECT_EQ(admission.pending(), 0u);
  EXPECT_EQ(admission.Check("c", 2), Refusal::kNone);
  admission.EndPending("a");  // ended after the clear: not counted twice
  EXPECT_EQ(admission.pending(), 0u);
}

TEST(AdmissionTest, ZeroLimitsRefuseEverything) {
  EXPECT_EQ(Admission({.max_pending = 0, .max_pending_per_source = 1, .max_open = 1}).Check("a", 0),
            Refusal::kPending);
  EXPECT_EQ(Admission({.max_pending = 1, .max_pending_per_source = 1, .max_open = 0}).Check("a", 0),
            Refusal::kOpen);
}

}  // namespace
}  // namespace kvwire
