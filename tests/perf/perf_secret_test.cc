// kvwire-perf's --secret-file / --secret, as users run it (a target process and an initiator
// process on loopback): the engines authenticate with the secret, so an initiator with
// another one is refused with an error that says so, and one with the same secret (from a
// file or argv) moves bytes that --check verifies. A secret file others can read is refused.
#include <sys/stat.h>
#include <sys/wait.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "tests/perf/perf_target.h"

namespace {

using ::testing::HasSubstr;

using Target = ::kvwire::testing::PerfTarget;

int RunInitiator(const std::vector<std::string>& args, std::string* output) {
  return ::kvwire::testing::RunPerfInitiator(args, output);
}

std::string SecretFile(const std::string& name, const std::string& secret, mode_t mode) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path) << secret << "\n";
  chmod(path.c_str(), mode);
  return path;
}

const std::vector<std::string> kTest = {"--transport", "tcp", "-s", "64K",    "-n",
                                        "16",          "-l",  "2",  "--check"};

std::vector<std::string> Initiator(int port, std::vector<std::string> secret) {
  std::vector<std::string> args = kTest;
  args.insert(args.end(), secret.begin(), secret.end());
  args.insert(args.end(), {"-p", absl::StrCat(port), "127.0.0.1"});
  return args;
}

TEST(PerfSecretTest, WrongSecretIsRefusedRightSecretMovesCheckedBytes) {
  const std::string right = SecretFile("perf-right", "perf-secret-1", 0600);
  const std::string wrong = SecretFile("perf-wrong", "perf-secret-2", 0600);
  std::vector<std::string> target_args = kTest;
  target_args.insert(target_args.end(), {"--bind", "127.0.0.1", "--secret-file", right});
  {
    Target target(target_args);
    ASSERT_GT(target.port(), 0);
    std::string out;
    EXPECT_NE(RunInitiator(Initiator(target.port(), {"--secret-file", wrong}), &out), 0) << out;
    EXPECT_THAT(out, HasSubstr("secret"));
    EXPECT_THAT(out, ::testing::Not(HasSubstr(" ok\n")));
    // The target gives up too once the refused initiator closed its side channel.
    EXPECT_EQ(target.Wait(absl::Seconds(60)), 1);
  }
  {
    Target target(target_args);
    ASSERT_GT(target.port(), 0);
    std::string out;
    EXPECT_NE(RunInitiator(Initiator(target.port(), {}), &out), 0) << out;  // no secret at all
    EXPECT_THAT(out, HasSubstr("secret"));
    EXPECT_EQ(target.Wait(absl::Seconds(60)), 1);
  }
  {
    Target target(target_args);
    ASSERT_GT(target.port(), 0);
    std::string out;
    EXPECT_EQ(RunInitiator(Initiator(target.port(), {"--secret-file", right}), &out), 0) << out;
    EXPECT_THAT(out, HasSubstr(" ok\n"));
    EXPECT_EQ(target.Wait(absl::Seconds(60)), 0);
  }
  {
    Target target(target_args);
    ASSERT_GT(target.port(), 0);
    std::string out;
    EXPECT_EQ(RunInitiator(Initiator(target.port(), {"--secret", "perf-secret-1"}), &out), 0)
        << out;
    EXPECT_THAT(out, HasSubstr(" ok\n"));
    EXPECT_EQ(target.Wait(absl::Seconds(60)), 0);
  }
}

TEST(PerfSecretTest, UnsafeOrConflictingSecretOptionsAreRefused) {
  const std::string readable = SecretFile("perf-readable", "perf-secret-3", 0644);
  std::string out;
  EXPECT_NE(RunInitiator({"--secret-file", readable, "-p", "1", "127.0.0.1"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("chmod 600"));
  out.clear();
  EXPECT_EQ(RunInitiator({"--secret-file", readable, "--secret", "x", "127.0.0.1"}, &out), 2)
      << out;
  EXPECT_THAT(out, HasSubstr("exclude each other"));
}

}  // namespace
