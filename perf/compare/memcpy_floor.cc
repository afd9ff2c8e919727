// kvwire-memcpy-floor: the shm floor. Copies blocks of one size between two buffers with the
// same placement as kvwire-perf (hot: one buffer reused; pool: blocks in random order over a
// pool on each side) and prints decimal GB/s (1e9 B/s).
//
//   kvwire-memcpy-floor -s BYTES [--pattern hot|pool] [--pool-mib N] [-n OPS] [-T THREADS]
//                       [--floor-memory anon|memfd]
// --floor-memory memfd copies between two kvwire::ShareableBuffers (memfd shared memory, what
// kvwire-perf registers) instead of two std::vectors (anonymous memory, the default), so that
// a difference the kind of memory makes (page size, THP) can be told from one the engine
// makes. Page faults taken inside the timed copies go to stderr.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kvwire/memory.h"
#include "perf/buffer_plan.h"
#include "perf/perf_options.h"

namespace {

long MinorFaults() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

}  // namespace

int main(int argc, char** argv) {
  // --floor-memory is this tool's own: taken out before the shared option parser sees it.
  std::vector<char*> args;
  std::string memory = "anon";
  for (int i = 0; i < argc; ++i) {
    if (std::string(argv[i]) == "--floor-memory" && i + 1 < argc) {
      memory = argv[++i];
      continue;
    }
    args.push_back(argv[i]);
  }
  if (memory != "anon" && memory != "memfd") {
    std::fprintf(stderr, "kvwire-memcpy-floor: --floor-memory anon or memfd, not %s\n",
                 memory.c_str());
    return 2;
  }
  absl::StatusOr<kvwire::perf::PerfOptions> parsed =
      kvwire::perf::ParsePerfOptions(static_cast<int>(args.size()), args.data());
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
  std::vector<std::byte> src_anon, dst_anon;
  kvwire::ShareableBuffer src_memfd, dst_memfd;
  std::byte* src = nullptr;
  std::byte* dst = nullptr;
  if (memory == "anon") {
    src_anon.assign(bytes, std::byte{1});
    dst_anon.assign(bytes, std::byte{2});
    src = src_anon.data();
    dst = dst_anon.data();
  } else {
    absl::StatusOr<kvwire::ShareableBuffer> a = kvwire::ShareableBuffer::Create(bytes, "floor");
    absl::StatusOr<kvwire::ShareableBuffer> b = kvwire::ShareableBuffer::Create(bytes, "floor");
    if (!a.ok() || !b.ok()) {
      std::fprintf(stderr, "kvwire-memcpy-floor: memfd: %s\n",
                   std::string((a.ok() ? b : a).status().message()).c_str());
      return 1;
    }
    src_memfd = *std::move(a);
    dst_memfd = *std::move(b);
    src = src_memfd.data();
    dst = dst_memfd.data();
    std::memset(src, 1, bytes);  // touched, as kvwire-perf's MakeBuffer does
    std::memset(dst, 2, bytes);
  }
  kvwire::perf::BufferPlan plan(o.pattern, o.threads, o.size, bytes);
  const uint64_t iters = o.IterationsFor(o.size);
  const uint64_t warmup = kvwire::perf::WarmupOps(o, plan, iters);
  auto copy = [&](int t, uint64_t from, uint64_t to) {
    for (uint64_t i = from; i < to; ++i) {
      std::memcpy(dst + plan.RemoteOffset(t, i), src + plan.LocalOffset(t, i), o.size);
    }
  };
  std::vector<double> seconds(o.threads);
  std::vector<long> faults(o.threads);
  std::vector<std::thread> threads;
  for (int t = 0; t < o.threads; ++t) {
    threads.emplace_back([&, t] {
      copy(t, 0, warmup);
      const long faults0 = MinorFaults();
      const auto start = std::chrono::steady_clock::now();
      copy(t, warmup, warmup + iters);
      seconds[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      faults[t] = MinorFaults() - faults0;
    });
  }
  for (std::thread& t : threads) t.join();
  double slowest = 0;
  for (double s : seconds) slowest = std::max(slowest, s);
  const double gbs = static_cast<double>(iters * o.size * o.threads) / slowest / 1e9;
  std::fprintf(stderr, "memcpy %s: %ld minor page faults (process) in thread 0's timed copies\n",
               memory.c_str(), faults[0]);
  std::printf("memcpy %llu %s %d %.3f\n", static_cast<unsigned long long>(o.size),
              kvwire::perf::PatternName(o.pattern), o.threads, gbs);
  return 0;
}
