// kvwire-perf as users run it: a target process and an initiator process, short runs with
// --check over shm and tcp, the option agreement check, and the JSON/CSV files. Never a speed.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <ostream>
#include <signal.h>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "tests/perf/perf_target.h"

namespace {

using ::testing::HasSubstr;

using Target = ::kvwire::testing::PerfTarget;

int RunInitiator(const std::vector<std::string>& args, std::string* output) {
  return ::kvwire::testing::RunPerfInitiator(args, output);
}

// Hot tcp cases write one destination buffer from several receive threads at once (identical
// bytes, as perftest does). Under ThreadSanitizer their two processes run with
// tests/perf/hot_tcp_tsan.supp, which says why that report is not a defect and suppresses
// only the receive frame, in those processes only.
struct Case {
  std::string transport;
  std::string op;
  std::string pattern;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.transport << " " << c.op << " " << c.pattern;
}

// Points the children's TSAN_OPTIONS at another suppressions file for one scope (the last
// suppressions= wins); no effect on builds without ThreadSanitizer.
class ScopedTsanSuppressions {
 public:
  explicit ScopedTsanSuppressions(const std::string& file) {
    const char* old = std::getenv("TSAN_OPTIONS");
    had_ = old != nullptr;
    old_ = had_ ? old : "";
    setenv("TSAN_OPTIONS", absl::StrCat(old_, had_ ? ":" : "", "suppressions=", file).c_str(), 1);
  }
  ~ScopedTsanSuppressions() {
    if (had_) {
      setenv("TSAN_OPTIONS", old_.c_str(), 1);
    } else {
      unsetenv("TSAN_OPTIONS");
    }
  }

 private:
  bool had_ = false;
  std::string old_;
};

class PerfRunTest : public ::testing::TestWithParam<Case> {};

TEST_P(PerfRunTest, ChecksEveryByteAndPrintsTheTable) {
  const Case& c = GetParam();
  std::unique_ptr<ScopedTsanSuppressions> hot_tcp;
  if (c.transport == "tcp" && c.pattern == "hot") {
    hot_tcp = std::make_unique<ScopedTsanSuppressions>(KVWIRE_HOT_TCP_TSAN_SUPP);
  }
  std::vector<std::string> test = {"--transport", c.transport,  "--op", c.op,     "--pattern",
                                   c.pattern,     "--pool-mib", "8",    "-s",     "64K",
                                   "-n",          "64",         "-l",   "4",      "-t",
                                   "2",           "-T",         "2",    "--check"};
  Target target(test);
  ASSERT_GT(target.port(), 0);
  // One pair of files per case and process: ctest runs the cases at once, and a shared name
  // let one case truncate the file another was reading.
  const std::string stem = absl::StrCat(testing::TempDir(), "/perf_run_", c.transport, "_", c.op,
                                        "_", c.pattern, "_", ::getpid());
  const std::string json = stem + ".json";
  const std::string csv = stem + ".csv";
  std::vector<std::string> args = test;
  args.insert(args.end(),
              {"-p", absl::StrCat(target.port()), "--json", json, "--csv", csv, "127.0.0.1"});
  std::string out;
  EXPECT_EQ(RunInitiator(args, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("decimal GB/s"));
  EXPECT_THAT(out, HasSubstr("#bytes"));
  EXPECT_THAT(out, HasSubstr("BW average[GB/sec]"));
  EXPECT_THAT(out, HasSubstr(" 65536 "));
  EXPECT_THAT(out, HasSubstr(" ok\n"));
  EXPECT_THAT(out, HasSubstr(c.transport));
  std::string target_out;
  EXPECT_EQ(target.Wait(absl::Seconds(60), &target_out), 0) << target_out;
  std::stringstream j, v;
  j << std::ifstream(json).rdbuf();
  v << std::ifstream(csv).rdbuf();
  EXPECT_THAT(j.str(), HasSubstr("\"bytes\": 65536"));
  EXPECT_THAT(j.str(), HasSubstr("\"check\": \"ok\""));
  EXPECT_THAT(v.str(), HasSubstr("bw_avg_gbs"));
  EXPECT_THAT(v.str(), HasSubstr(",65536,"));
  std::remove(json.c_str());
  std::remove(csv.c_str());
}

INSTANTIATE_TEST_SUITE_P(Transports, PerfRunTest,
                         ::testing::Values(Case{"shm", "write", "hot"}, Case{"shm", "read", "pool"},
                                           Case{"tcp", "write", "pool"},
                                           Case{"tcp", "read", "pool"}, Case{"tcp", "write", "hot"},
                                           Case{"tcp", "read", "hot"}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.transport + "_" + info.param.op + "_" +
                                  info.param.pattern;
                         });

TEST(PerfRunTest, KvWorkloadMovesWholeRequestsAndChecksThem) {
  for (const char* op : {"write", "read"}) {
    std::vector<std::string> test = {
        "--workload", "kv", "--layout", "dsv4-flash", "--prompt",   "1024",
        "--requests", "2",  "--frag",   "0.5",        "--pool-mib", "16",
        "-n",         "6",  "--op",     op,           "--check"};
    Target target(test);
    ASSERT_GT(target.port(), 0);
    std::vector<std::string> args = test;
    args.insert(args.end(), {"-p", absl::StrCat(target.port()), "127.0.0.1"});
    std::string out;
    EXPECT_EQ(RunInitiator(args, &out), 0) << out;
    EXPECT_THAT(out, HasSubstr("KV request Test"));
    EXPECT_THAT(out, HasSubstr("#bytes/req"));
    EXPECT_THAT(out, HasSubstr(" ok\n"));
    std::string target_out;
    EXPECT_EQ(target.Wait(absl::Seconds(60), &target_out), 0) << target_out;
  }
}

// perftest's -b: every other transfer goes the other way, so bytes move in both directions
// (this engine's counters show both); the options in perftest's attached forms.
TEST(PerfRunTest, BidirectionalMovesBytesBothWays) {
  for (const char* transport : {"shm", "tcp"}) {
    SCOPED_TRACE(transport);
    std::vector<std::string> test = {"--transport", transport,    "-s64K", "-n64",
                                     "-l2",         "-t2",        "-b",    "--pattern",
                                     "pool",        "--pool-mib", "8",     "-F"};
    Target target(test);
    ASSERT_GT(target.port(), 0);
    const std::string json = testing::TempDir() + "/perf_bidir.json";
    std::vector<std::string> args = test;
    args.insert(args.end(),
                {"-p", absl::StrCat(target.port()), "--report_gbits", "--json", json, "127.0.0.1"});
    std::string out;
    ASSERT_EQ(RunInitiator(args, &out), 0) << out;
    EXPECT_THAT(out, HasSubstr("(bidirectional)"));
    EXPECT_THAT(out, HasSubstr("Gb/sec"));
    unsigned long long written = 0, read = 0;
    const size_t at = out.find(" Bidirectional     : ");
    ASSERT_NE(at, std::string::npos) << out;
    ASSERT_EQ(std::sscanf(out.c_str() + at, " Bidirectional : %llu bytes written, %llu bytes read",
                          &written, &read),
              2)
        << out.substr(at, 100);
    // 64 ops of 64 KiB each, warm-up included: half each way, in whole transfers of 2 ops.
    EXPECT_GE(written, 32ull * 65536) << out;
    EXPECT_GE(read, 32ull * 65536) << out;
    std::stringstream j;
    j << std::ifstream(json).rdbuf();
    EXPECT_THAT(j.str(), HasSubstr("\"-b\": \"on\""));
    std::string target_out;
    EXPECT_EQ(target.Wait(absl::Seconds(60), &target_out), 0) << target_out;
  }
}

TEST(PerfRunTest, DifferentOptionsAreRefusedOnBothSides) {
  Target target({"-s", "64K", "-l", "4"});
  ASSERT_GT(target.port(), 0);
  std::string out;
  EXPECT_EQ(
      RunInitiator({"-s1M", "-l4", "-b", "-p", absl::StrCat(target.port()), "127.0.0.1"}, &out), 2)
      << out;
  EXPECT_THAT(out, HasSubstr("the target refused the test"));
  EXPECT_THAT(out, HasSubstr("-s/-a is 65536 here but 1048576 on the initiator"));
  EXPECT_THAT(out, HasSubstr("-b is off here but on on the initiator"));
  std::string target_out;
  EXPECT_EQ(target.Wait(absl::Seconds(60), &target_out), 2);
}

TEST(PerfRunTest, UnavailableFeaturesSayWhy) {
  std::string out;
  // A build has at most one GPU runtime: the flag of the other is refused, saying which the
  // build has; the build's own fails at the device (none here, or no target to run against).
  std::string cuda, rocm;
  EXPECT_NE(RunInitiator({"--use_cuda=0", "-p", "1", "127.0.0.1"}, &cuda), 0);
  EXPECT_NE(RunInitiator({"--use_rocm=0", "-p", "1", "127.0.0.1"}, &rocm), 0);
  EXPECT_THAT(cuda + rocm, ::testing::ContainsRegex("this build has no GPU runtime|this build's "
                                                    "GPU runtime is"));
  out.clear();
  EXPECT_EQ(RunInitiator({"--help"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("usage: kvwire-perf"));
}

}  // namespace
