// Bandwidth of the tcp transport over loopback, for running by hand (never asserts speed):
//
//   build/tests/bench/tcp_bandwidth_bench
//
// Environment: KVWIRE_BENCH_BYTES (bytes per run, default 2 GiB), KVWIRE_BENCH_SPAN (bytes of
// the buffers the ops cycle through, default 256 MiB: a KV pool, not a cache-resident buffer),
// KVWIRE_BENCH_RUNS (runs per configuration, default 3; the median is printed),
// KVWIRE_BENCH_SOCKBUF (TcpTransportOptions::socket_buffer_bytes, default the option's),
// KVWIRE_BENCH_KINDS / _OPS / _LANES (comma lists, default "WRITE,READ" / "1048576,65536" /
// "1,4").
// Prints decimal GB/s (10^9 B/s).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "src/util/mutex.h"
#include "tests/support/fake_target_hooks.h"
#include "transport/tcp/tcp_transport.h"

namespace kvwire::transport {
namespace {

std::vector<std::string> EnvList(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return absl::StrSplit(v != nullptr ? v : fallback, ',', absl::SkipEmpty());
}

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  uint64_t out = 0;
  return v != nullptr && absl::SimpleAtoi(v, &out) ? out : fallback;
}

// Keeps `window` Posts in flight per lane until `total` bytes moved; returns GB/s.
double MeasureGbps(Channel& channel, OpKind kind, std::byte* local, uint64_t span,
                   uint64_t op_bytes, uint32_t lanes, uint64_t total) {
  const uint64_t post_bytes = std::max<uint64_t>(op_bytes, 8 << 20);
  const uint64_t ops_per_post = post_bytes / op_bytes;
  const uint64_t posts = std::max<uint64_t>(1, total / post_bytes);
  const uint64_t window = 4 * lanes;
  Mutex mu;
  CondVar cv;
  uint64_t done = 0;
  uint64_t failed = 0;
  uint64_t next_op = 0;
  const absl::Time start = absl::Now();
  for (uint64_t p = 0; p < posts; ++p) {
    {
      MutexLock lock(&mu);
      while (p - done >= window) cv.Wait(&mu);
    }
    PostRequest request;
    request.transfer_id = p;
    request.kind = kind;
    request.lane = static_cast<uint32_t>(p % lanes);
    request.ops.reserve(ops_per_post);
    for (uint64_t i = 0; i < ops_per_post; ++i, ++next_op) {
      const uint64_t offset = (next_op * op_bytes) % (span - span % op_bytes);
      request.ops.push_back({local + offset, 1, offset, op_bytes});
    }
    channel.Post(std::move(request), [&](absl::Status s) {
      MutexLock lock(&mu);
      ++done;
      if (!s.ok()) ++failed;
      cv.Signal();
    });
  }
  MutexLock lock(&mu);
  while (done < posts) cv.Wait(&mu);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  EXPECT_EQ(failed, 0u);
  return static_cast<double>(posts * ops_per_post * op_bytes) / seconds / 1e9;
}

TEST(TcpBandwidth, LoopbackWriteAndRead) {
  const uint64_t total = EnvOr("KVWIRE_BENCH_BYTES", uint64_t{2} << 30);
  const uint64_t span = EnvOr("KVWIRE_BENCH_SPAN", 256 << 20);
  const uint64_t runs = EnvOr("KVWIRE_BENCH_RUNS", 3);
  TcpTransportOptions options;
  options.socket_buffer_bytes =
      static_cast<int>(EnvOr("KVWIRE_BENCH_SOCKBUF", options.socket_buffer_bytes));
  // One region (id 1), every access allowed, every peer let in: only the transport's cost is
  // measured.
  kvwire::testing::FakeTargetHooks target_hooks(kvwire::testing::AnyToken(1));
  kvwire::testing::FakeTargetHooks initiator_hooks(kvwire::testing::AnyToken(1));
  const RegionId region = target_hooks.AllocateRegion(span, kRemoteReadWrite);  // MeasureGbps's 1
  auto target = CreateTcpTransport(options, &target_hooks);
  auto initiator = CreateTcpTransport(options, &initiator_hooks);
  ASSERT_TRUE(target.ok() && initiator.ok());
  std::vector<std::byte> local(span, std::byte{1});
  std::memset(target_hooks.data(region), 2, span);

  std::printf("tcp loopback, %.2f GiB per run, span %llu MiB, sockbuf %d, median of %llu\n",
              static_cast<double>(total) / (1 << 30), static_cast<unsigned long long>(span >> 20),
              options.socket_buffer_bytes, static_cast<unsigned long long>(runs));
  std::printf("%-6s %10s %6s %10s\n", "op", "op bytes", "lanes", "GB/s");
  for (const std::string& kind_name : EnvList("KVWIRE_BENCH_KINDS", "WRITE,READ")) {
    const OpKind kind = kind_name == "READ" ? OpKind::kRead : OpKind::kWrite;
    for (const std::string& op_text : EnvList("KVWIRE_BENCH_OPS", "1048576,65536")) {
      uint64_t op_bytes = 0;
      ASSERT_TRUE(absl::SimpleAtoi(op_text, &op_bytes) && op_bytes > 0) << op_text;
      for (const std::string& lanes_text : EnvList("KVWIRE_BENCH_LANES", "1,4")) {
        uint32_t lanes = 0;
        ASSERT_TRUE(absl::SimpleAtoi(lanes_text, &lanes) && lanes > 0) << lanes_text;
        PeerLink link;
        link.remote_endpoint = (*target)->Endpoint();
        link.lanes = lanes;
        link.deadline = absl::Now() + absl::Seconds(10);
        auto channel = (*initiator)->Connect(link);
        ASSERT_TRUE(channel.ok()) << channel.status();
        std::vector<double> results;
        for (uint64_t r = 0; r < runs; ++r) {
          results.push_back(
              MeasureGbps(**channel, kind, local.data(), span, op_bytes, lanes, total));
        }
        std::sort(results.begin(), results.end());
        std::printf("%-6s %10llu %6u %10.2f\n", kind == OpKind::kWrite ? "WRITE" : "READ",
                    static_cast<unsigned long long>(op_bytes), lanes, results[results.size() / 2]);
        std::fflush(stdout);
      }
    }
  }
  for (const auto& [peer, error] : target_hooks.peer_errors()) {
    std::fprintf(stderr, "peer error: %s\n", std::string(error.message()).c_str());
  }
}

}  // namespace
}  // namespace kvwire::transport
