// The harness judges the second process: a child that fails must fail the test that ran it.
// Planted children (/bin/sh) end badly in each way; Child::Stop must report each as a
// (non-fatal) gtest failure, and stay quiet for a clean exit or a deliberate Kill().
#include "tests/connector/child.h"

#include <sys/wait.h>

#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"

namespace kvwire::testing {
namespace {

std::unique_ptr<Child> Shell(const std::string& script) {
  auto child = Child::Start("/bin/sh", {"-c", script});
  EXPECT_TRUE(child.ok()) << child.status();
  return child.ok() ? std::move(*child) : nullptr;
}

TEST(ChildTest, CleanExitIsNotAFailure) {
  auto child = Shell("echo READY; exit 0");
  ASSERT_NE(child, nullptr);
  ASSERT_TRUE(child->Expect("READY", absl::Seconds(10)).ok());
  child->Stop();
  EXPECT_EQ(child->end_problem(), "");
}

TEST(ChildTest, NonZeroExitFailsTheTest) {
  auto child = Shell("exit 66");  // ThreadSanitizer's exit code
  ASSERT_NE(child, nullptr);
  EXPECT_NONFATAL_FAILURE(child->Stop(), "exited with status 66");
}

TEST(ChildTest, DeathBySignalFailsTheTest) {
  auto child = Shell("kill -SEGV $$");
  ASSERT_NE(child, nullptr);
  EXPECT_NONFATAL_FAILURE(child->Stop(), "died of signal 11");
}

TEST(ChildTest, HangOnExitFailsTheTest) {
  auto child = Shell("exec sleep 30");
  ASSERT_NE(child, nullptr);
  EXPECT_NONFATAL_FAILURE(child->Stop(absl::Milliseconds(300)), "was killed");
}

TEST(ChildTest, DeliberateKillIsNotAFailure) {
  auto child = Shell("exec sleep 30");
  ASSERT_NE(child, nullptr);
  child->Kill();
  child->Stop();
  EXPECT_EQ(child->end_problem(), "");
}

TEST(ChildTest, BadExitBeforeADeliberateKillFailsTheTest) {
  auto child = Shell("exit 23");  // LeakSanitizer's exit code, before the test kills it
  ASSERT_NE(child, nullptr);
  // Until it has exited (seen without reaping it: Kill must still find its status).
  siginfo_t info{};
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       info.si_pid == 0 && absl::Now() < until;) {
    ASSERT_EQ(waitid(P_PID, child->pid(), &info, WEXITED | WNOHANG | WNOWAIT), 0);
    if (info.si_pid == 0) absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_NE(info.si_pid, 0) << "the planted child did not exit";
  EXPECT_NONFATAL_FAILURE(child->Kill(), "exited with status 23");
}

}  // namespace
}  // namespace kvwire::testing
