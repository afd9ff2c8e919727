// kvwire-memcpy-floor: the shm floor. Copies blocks of one size between two buffers with the
// same placement as kvwire-perf (hot: one buffer reused; pool: blocks in random order over a
// pool on each side) and prints decimal GB/s (1e9 B/s).
//
//   kvwire-memcpy-floor -s BYTES [--pattern hot|pool] [--pool-mib N] [-n OPS] [-T THREADS]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "perf/buffer_plan.h"
#include "perf/perf_options.h"

int main(int argc, char** argv) {
  absl::StatusOr<kvwire::perf::PerfOptions> parsed = kvwire::perf::ParsePerfOptions(argc, argv);
  if (!parsed.ok() || parsed->is_client() || parsed->all_sizes) {
    std::fprintf(
        stderr,
        "kvwire-memcpy-floor: %s\nusage: kvwire-memcpy-floor -s BYTES "
        "[--pattern hot|pool] [--pool-mib N] [-n OPS] [-T THREADS]\n",
        parsed.ok() ? "one size, no host" : std::string(parsed.status().message()).c_str());
    return 2;
  }
  const kvwire::perf::PerfOptions& o = *parsed;
  const uint64_t bytes = kvwire::perf::RawRegionBytes(o);
  std::vector<std::byte> src(bytes, std::byte{1}), dst(bytes, std::byte{2});
  kvwire::perf::BufferPlan plan(o.pattern, o.threads, o.size, bytes);
  const uint64_t iters = o.IterationsFor(o.size);
  const uint64_t warmup = o.WarmupFor(iters);
  auto copy = [&](int t, uint64_t from, uint64_t to) {
    for (uint64_t i = from; i < to; ++i) {
      std::memcpy(dst.data() + plan.RemoteOffset(t, i), src.data() + plan.LocalOffset(t, i),
                  o.size);
    }
  };
  std::vector<double> seconds(o.threads);
  std::vector<std::thread> threads;
  for (int t = 0; t < o.threads; ++t) {
    threads.emplace_back([&, t] {
      copy(t, 0, warmup);
      const auto start = std::chrono::steady_clock::now();
      copy(t, warmup, warmup + iters);
      seconds[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }
  for (std::thread& t : threads) t.join();
  double slowest = 0;
  for (double s : seconds) slowest = std::max(slowest, s);
  const double gbs = static_cast<double>(iters * o.size * o.threads) / slowest / 1e9;
  std::printf("memcpy %llu %s %d %.3f\n", static_cast<unsigned long long>(o.size),
              kvwire::perf::PatternName(o.pattern), o.threads, gbs);
  return 0;
}
