// The servers' process helper judges how a child ended, so that the e2e tests fail when a
// server they started crashed, exited non-zero (a sanitizer report or leak under ASan/UBSan/
// TSan) or hung on SIGTERM. Each case plants a child (/bin/sh) that ends one way.
#include "examples/dsv4/serve/process.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dsv4::serve {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Process> Sh(const std::string& script) {
  const std::string log = absl::StrCat(
      ::testing::TempDir(), "/process_test.",
      ::testing::UnitTest::GetInstance()->current_test_info()->name(), ".", getpid(), ".log");
  // Process::Start appends: a log left by an earlier run whose pid was the same would hold
  // its output (a test that waits for a word would find it before this shell wrote it).
  std::remove(log.c_str());
  absl::StatusOr<std::unique_ptr<Process>> p = Process::Start("/bin/sh", {"-c", script}, log);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : nullptr;
}

TEST(ProcessEndTest, ExitZeroIsClean) {
  auto p = Sh("exit 0");
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(p->Wait(absl::Seconds(30)).value_or(-1), 0);
  EXPECT_EQ(p->EndProblem(), "");
}

TEST(ProcessEndTest, NonZeroExitIsAProblem) {
  auto p = Sh("exit 66");  // ThreadSanitizer's exit code
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(p->Wait(absl::Seconds(30)).value_or(-1), 66);
  EXPECT_THAT(p->EndProblem(), HasSubstr("exited with status 66"));
}

TEST(ProcessEndTest, NonZeroExitBeforeTheTestsSigkillIsStillAProblem) {
  auto p = Sh("exit 23");  // LeakSanitizer's exit code, before the test kills it
  ASSERT_NE(p, nullptr);
  // Reaped by Running() here or by Stop itself: either way the exit code is what counts.
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       p->Running() && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  p->Stop(SIGKILL);
  EXPECT_THAT(p->EndProblem(), HasSubstr("exited with status 23"));
}

TEST(ProcessEndTest, SignalNobodySentIsAProblem) {
  auto p = Sh("kill -KILL $$");  // as if the OOM killer took it
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(p->Wait(absl::Seconds(30)).value_or(-1), 128 + SIGKILL);
  EXPECT_THAT(p->EndProblem(), HasSubstr("died of signal 9"));
}

TEST(ProcessEndTest, DeliberateSigkillIsClean) {
  auto p = Sh("exec sleep 30");
  ASSERT_NE(p, nullptr);
  p->Stop(SIGKILL);
  EXPECT_EQ(p->exit_code(), 128 + SIGKILL);
  EXPECT_EQ(p->EndProblem(), "");
}

TEST(ProcessEndTest, IgnoringSigtermUntilKilledIsAProblem) {
  // The shell ignores SIGTERM and waits in a loop of short sleeps (so that it runs the trap).
  auto p = Sh("trap '' TERM; echo armed; while :; do sleep 0.05; done");
  ASSERT_NE(p, nullptr);
  // The trap is set once the shell printed "armed" (a condition, not a sleep).
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       p->LogTail().find("armed") == std::string::npos && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  p->Stop(SIGTERM, absl::Milliseconds(300));
  EXPECT_THAT(p->EndProblem(), HasSubstr("was killed"));
}

}  // namespace
}  // namespace dsv4::serve
