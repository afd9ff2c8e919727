// kvwire-perf's parts that need no second process: options, agreement, plans, summaries.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "perf/buffer_plan.h"
#include "perf/kv_workload.h"
#include "perf/perf_options.h"
#include "perf/results.h"

namespace kvwire::perf {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<PerfOptions> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "kvwire-perf");
  return ParsePerfOptions(static_cast<int>(args.size()), args.data());
}

TEST(PerfOptionsTest, DefaultsAreATargetWritingHot64KiB) {
  auto o = Parse({});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->is_client());
  EXPECT_EQ(o->op, OpKind::kWrite);
  EXPECT_EQ(o->transport, TransportKind::kAuto);
  EXPECT_EQ(o->Sizes(), std::vector<uint64_t>{65536});
  EXPECT_EQ(o->pattern, Pattern::kHot);
}

TEST(PerfOptionsTest, PerftestStyleOptionsAndHost) {
  auto o = Parse({"-o",
                  "read",
                  "--transport=tcp",
                  "-s",
                  "1M",
                  "-l",
                  "8",
                  "-n",
                  "100",
                  "-w",
                  "5",
                  "-q",
                  "2",
                  "-t",
                  "16",
                  "-T",
                  "2",
                  "--pattern",
                  "pool",
                  "--pool-mib",
                  "64",
                  "--check",
                  "--report-gbits",
                  "--json",
                  "/tmp/x.json",
                  "10.0.0.1"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->is_client());
  EXPECT_EQ(o->host, "10.0.0.1");
  EXPECT_EQ(o->op, OpKind::kRead);
  EXPECT_EQ(o->transport, TransportKind::kTcp);
  EXPECT_EQ(o->size, 1u << 20);
  EXPECT_EQ(o->batch, 8);
  EXPECT_EQ(o->iterations, 100u);
  EXPECT_EQ(o->WarmupFor(100), 5u);
  EXPECT_EQ(o->connections, 2);
  EXPECT_EQ(o->outstanding, 16);
  EXPECT_EQ(o->threads, 2);
  EXPECT_TRUE(o->check);
  EXPECT_TRUE(o->report_gbits);
  EXPECT_EQ(o->json_file, "/tmp/x.json");
}

// perftest's spellings: attached short values, grouped flags, long options with '=' or a
// separate value, -b for bidirectional (batch is -l/--post_list), -F accepted.
TEST(PerfOptionsTest, GetoptForms) {
  auto o = Parse({"-s65536", "-l8", "-bF", "-n100", "--tx-depth=4", "--threads", "2", "-oread",
                  "--report_gbits", "10.0.0.1"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->size, 65536u);
  EXPECT_EQ(o->batch, 8);
  EXPECT_TRUE(o->bidirectional);
  EXPECT_EQ(o->iterations, 100u);
  EXPECT_EQ(o->outstanding, 4);
  EXPECT_EQ(o->threads, 2);
  EXPECT_EQ(o->op, OpKind::kRead);
  EXPECT_TRUE(o->report_gbits);
  EXPECT_EQ(o->host, "10.0.0.1");
  // The host may come first (getopt permutes), and the old dash spelling still works.
  auto p = Parse({"10.0.0.2", "--post_list", "3", "--report-gbits", "--bidirectional"});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->host, "10.0.0.2");
  EXPECT_EQ(p->batch, 3);
  EXPECT_TRUE(p->bidirectional);
  EXPECT_TRUE(p->report_gbits);
  // -b takes no value now: a number after it is a (second) host, not a batch.
  EXPECT_THAT(Parse({"-b", "4", "10.0.0.1"}).status().message(), HasSubstr("more than one HOST"));
  EXPECT_FALSE(Parse({"-l0"}).ok());
  // Parsing twice in one process starts over.
  auto again = Parse({"-s4K"});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->size, 4096u);
  EXPECT_FALSE(again->bidirectional);
}

// GPU memory: refused with the reason in a build without that runtime; with it, the device.
TEST(PerfOptionsTest, GpuMemoryFlags) {
  for (const char* flag : {"--use_cuda=0", "--use_rocm=1", "--memory=gpu"}) {
    SCOPED_TRACE(flag);
    auto o = Parse({flag});
    if (!o.ok()) {
      EXPECT_THAT(std::string(o.status().message()),
                  ::testing::ContainsRegex("this build has no GPU runtime|this build's GPU "
                                           "runtime is"));
      continue;
    }
    EXPECT_EQ(o->memory, MemoryKind::kGpu);
  }
  EXPECT_THAT(Parse({"--use_cuda"}).status().message(), HasSubstr("--use_cuda needs a value"));
  EXPECT_THAT(Parse({"--use_cuda=x"}).status().message(), HasSubstr("--use_cuda"));
}

TEST(PerfOptionsTest, AllSizesArePowersOfTwoFrom4KiBTo64MiB) {
  auto o = Parse({"-a"});
  ASSERT_TRUE(o.ok()) << o.status();
  std::vector<uint64_t> sizes = o->Sizes();
  ASSERT_EQ(sizes.size(), 15u);
  EXPECT_EQ(sizes.front(), 4096u);
  EXPECT_EQ(sizes.back(), 64u << 20);
}

TEST(PerfOptionsTest, ClearErrors) {
  EXPECT_THAT(Parse({"--op", "send"}).status().message(), HasSubstr("read or write"));
  EXPECT_THAT(Parse({"--transport", "ib"}).status().message(), HasSubstr("rdma, tcp, shm"));
  EXPECT_THAT(Parse({"--bogus=1"}).status().message(), HasSubstr("unknown option --bogus"));
  EXPECT_THAT(Parse({"-Z"}).status().message(), HasSubstr("unknown option -Z"));
  EXPECT_THAT(Parse({"--check=yes"}).status().message(), HasSubstr("--check takes no value"));
  EXPECT_THAT(Parse({"--size"}).status().message(), HasSubstr("--size needs a value"));
  EXPECT_THAT(Parse({"-b", "--check"}).status().message(), HasSubstr("exclude"));
  EXPECT_THAT(Parse({"-b", "--workload", "kv"}).status().message(), HasSubstr("raw only"));
  EXPECT_THAT(Parse({"-d", "mlx5_0"}).status().message(), HasSubstr("rdma transport only"));
  EXPECT_THAT(Parse({"-n", "10", "-D", "2"}).status().message(), HasSubstr("exclude"));
  EXPECT_THAT(Parse({"-s", "4K", "-a"}).status().message(), HasSubstr("exclude"));
  EXPECT_THAT(Parse({"--bogus"}).status().message(), HasSubstr("unknown option --bogus"));
  EXPECT_THAT(Parse({"-s"}).status().message(), HasSubstr("needs a value"));
  EXPECT_THAT(Parse({"a", "b"}).status().message(), HasSubstr("more than one HOST"));
  EXPECT_TRUE(Parse({"--transport", "rdma", "-d", "mlx5_0", "-x", "3"}).ok());
}

TEST(PerfOptionsTest, AgreementNamesEveryDifference) {
  auto a = Parse({"-s", "64K", "-l", "4"});
  auto b = Parse({"-s", "1M", "-l", "4", "--check", "127.0.0.1"});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(CheckAgreement(AgreedSettings(*a), AgreedSettings(*a), "target").ok());
  absl::Status s = CheckAgreement(AgreedSettings(*a), AgreedSettings(*b), "initiator");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("-s/-a is 65536 here but 1048576 on the initiator"));
  EXPECT_THAT(s.message(), HasSubstr("--check is off here but on"));
  // Output options need not agree.
  auto c = Parse({"-s", "64K", "-l", "4", "--json", "f", "--report_gbits", "-F"});
  EXPECT_TRUE(CheckAgreement(AgreedSettings(*a), AgreedSettings(*c), "target").ok());
  // Bidirectional runs must be so on both sides.
  auto d = Parse({"-s", "64K", "-l", "4", "-b"});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_THAT(CheckAgreement(AgreedSettings(*a), AgreedSettings(*d), "initiator").message(),
              HasSubstr("-b is off here but on on the initiator"));
}

TEST(PerfOptionsTest, SettingsRoundTrip) {
  auto a = Parse({"--pattern", "pool", "-D", "1.5"});
  ASSERT_TRUE(a.ok());
  auto decoded = DecodeSettings(EncodeSettings(AgreedSettings(*a)));
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, AgreedSettings(*a));
  EXPECT_FALSE(DecodeSettings("novalue").ok());
}

TEST(BufferPlanTest, HotReusesOneBlockPerThread) {
  BufferPlan plan(Pattern::kHot, 2, 4096, 8192);
  EXPECT_EQ(plan.LocalOffset(0, 0), 0u);
  EXPECT_EQ(plan.LocalOffset(0, 99), 0u);
  EXPECT_EQ(plan.RemoteOffset(1, 7), 4096u);
}

TEST(BufferPlanTest, PoolVisitsEveryBlockOfTheThreadOncePerRound) {
  BufferPlan plan(Pattern::kPool, 2, 4096, 64 * 4096);
  ASSERT_EQ(plan.slots_per_thread(), 32u);
  std::vector<int> seen(64, 0);
  for (uint64_t i = 0; i < 32; ++i) {
    const uint64_t off = plan.RemoteOffset(1, i);
    ASSERT_EQ(off % 4096, 0u);
    ASSERT_GE(off / 4096, 32u);
    ++seen[off / 4096];
  }
  for (int b = 32; b < 64; ++b) EXPECT_EQ(seen[b], 1) << b;
  EXPECT_EQ(plan.RemoteOffset(1, 3), plan.RemoteOffset(1, 35));
}

TEST(BufferPlanTest, VerifyCatchesAMisplacedBlock) {
  const uint64_t size = 1000;  // not a multiple of 8: the pattern works byte-wise at the edges
  BufferPlan plan(Pattern::kPool, 1, size, 16 * size);
  std::vector<std::byte> src(16 * size), dst(16 * size);
  FillPattern(src.data(), 0, src.size());
  plan.ClearDestinations(dst.data(), true, 0, 100);
  for (uint64_t i = 0; i < 16; ++i) {
    std::memcpy(dst.data() + plan.RemoteOffset(0, i), src.data() + plan.LocalOffset(0, i), size);
  }
  EXPECT_TRUE(plan.Verify(dst.data(), true, 0, 100).ok());
  dst[plan.RemoteOffset(0, 5) + 17] ^= std::byte{1};
  absl::Status s = plan.Verify(dst.data(), true, 0, 100);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("op 5"));
  EXPECT_THAT(s.message(), HasSubstr("byte 17"));
}

TEST(ResultsTest, SummarizeComputesRatesAndPercentiles) {
  std::vector<TransferSample> samples;
  for (int i = 0; i < 100; ++i) {
    // 1 MB each, one every 10 ms, 1..100 us latency.
    samples.push_back(TransferSample{i * 0.01, i * 0.01 + (i + 1) * 1e-6, 2.0, 1000000, 4});
  }
  Result r;
  Summarize(samples, 1.0, 10, &r);
  EXPECT_EQ(r.ops, 400u);
  EXPECT_EQ(r.transfers, 100u);
  EXPECT_DOUBLE_EQ(r.bw_avg_gbs, 0.1);
  EXPECT_DOUBLE_EQ(r.msg_rate_mops, 0.0004);
  EXPECT_NEAR(r.lat_avg_us, 50.5, 1e-6);
  EXPECT_NEAR(r.lat_p50_us, 50.5, 1e-6);
  EXPECT_NEAR(r.lat_p99_us, 99.01, 1e-6);
  EXPECT_DOUBLE_EQ(r.post_avg_us, 2.0);
  EXPECT_GE(r.bw_peak_gbs, r.bw_avg_gbs);
  EXPECT_DOUBLE_EQ(Percentile({}, 50), 0);
}

// --dump-ranges writes the dsv4-pro 8k request's plan that `make compare` gives the peers: the
// same 3,096 pages the kv workload reports, as ranges inside both sides' buffers that add up
// to the request's bytes.
TEST(KvDumpRangesTest, Dsv4Pro8kRequestRanges) {
  const std::string path = ::testing::TempDir() + "/dsv4-pro-8k.ranges";
  auto o = Parse({"--workload", "kv", "--layout", "dsv4-pro", "--prompt", "8192", "--frag", "0.5",
                  "--requests", "1", "--dump-ranges", path.c_str()});
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_TRUE(DumpKvRanges(*o).ok());
  std::ifstream in(path);
  std::string magic;
  uint64_t bytes = 0, count = 0, request_bytes = 0, pages = 0;
  in >> magic >> bytes >> count >> request_bytes >> pages;
  EXPECT_EQ(magic, "kvwire-kv-ranges");
  EXPECT_EQ(pages, 3096u);
  EXPECT_GT(count, 0u);
  EXPECT_LE(count, pages);
  uint64_t src = 0, dst = 0, length = 0, sum = 0, read = 0;
  while (in >> src >> dst >> length) {
    EXPECT_GT(length, 0u);
    EXPECT_LE(src + length, bytes);
    EXPECT_LE(dst + length, bytes);
    sum += length;
    ++read;
  }
  EXPECT_EQ(read, count);
  EXPECT_EQ(sum, request_bytes);
  std::remove(path.c_str());
}

TEST(KvDumpRangesTest, ClearErrors) {
  EXPECT_THAT(Parse({"--dump-ranges", "x"}).status().message(), HasSubstr("--workload kv"));
  auto o = Parse({"--workload", "kv", "--dump-ranges", "/nonexistent-dir/x"});
  ASSERT_TRUE(o.ok());
  EXPECT_THAT(DumpKvRanges(*o).message(), HasSubstr("cannot write /nonexistent-dir/x"));
}

}  // namespace
}  // namespace kvwire::perf
