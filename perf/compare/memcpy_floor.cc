// kvwire-memcpy-floor: the shm floor. Copies blocks of one size between two buffers with the
// same placement as kvwire-perf (hot: one buffer reused; pool: blocks in random order over a
// pool on each side) and prints decimal GB/s (1e9 B/s).
//
//   kvwire-memcpy-floor -s BYTES [--pattern hot|pool] [--pool-mib N] [-n OPS] [-T THREADS]
//                       [--floor-memory anon|memfd]
//   kvwire-memcpy-floor --workload kv [--layout L] [--prompt N] [--frag F] [--requests R]
//                       [--pool-mib N] [-n COPIES] [--floor-memory anon|memfd]
// The kv form copies the ranges of kvwire-perf's kv workload (the same layout, blocks and
// plans: BuildKvPlans) one request at a time, in one thread, and prints the median and the
// fastest request in ms: the shm request's floor for perf/compare, measured apart from the
// tool it judges.
// --floor-memory memfd copies between two kvwire::ShareableBuffers (memfd shared memory, what
// kvwire-perf registers) instead of two std::vectors (anonymous memory, the default), so that
// a difference the kind of memory makes (page size, THP) can be told from one the engine
// makes. Page faults taken inside the timed copies go to stderr.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kvwire/memory.h"
#include "perf/buffer_plan.h"
#include "perf/kv_workload.h"
#include "perf/perf_options.h"

namespace {

long MinorFaults() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

// Two buffers of `bytes` (anonymous or memfd memory), touched; false (said why) on failure.
struct FloorBuffers {
  std::vector<std::byte> src_anon, dst_anon;
  kvwire::ShareableBuffer src_memfd, dst_memfd;
  std::byte* src = nullptr;
  std::byte* dst = nullptr;

  bool Make(const std::string& memory, uint64_t bytes) {
    if (memory == "anon") {
      src_anon.assign(bytes, std::byte{1});
      dst_anon.assign(bytes, std::byte{2});
      src = src_anon.data();
      dst = dst_anon.data();
      return true;
    }
    absl::StatusOr<kvwire::ShareableBuffer> a = kvwire::ShareableBuffer::Create(bytes, "floor");
    absl::StatusOr<kvwire::ShareableBuffer> b = kvwire::ShareableBuffer::Create(bytes, "floor");
    if (!a.ok() || !b.ok()) {
      std::fprintf(stderr, "kvwire-memcpy-floor: memfd: %s\n",
                   std::string((a.ok() ? b : a).status().message()).c_str());
      return false;
    }
    src_memfd = *std::move(a);
    dst_memfd = *std::move(b);
    src = src_memfd.data();
    dst = dst_memfd.data();
    std::memset(src, 1, bytes);  // touched, as kvwire-perf's MakeBuffer does
    std::memset(dst, 2, bytes);
    return true;
  }
};

// The kv form: one request's ranges at a time, cycling over the request slots.
int KvFloor(const kvwire::perf::PerfOptions& o, const std::string& memory) {
  absl::StatusOr<kvwire::perf::KvPlans> plans = kvwire::perf::BuildKvPlans(o);
  if (!plans.ok() || plans->plans.empty()) {
    std::fprintf(stderr, "kvwire-memcpy-floor: kv: %s\n",
                 plans.ok() ? "no request" : std::string(plans.status().message()).c_str());
    return 1;
  }
  FloorBuffers b;
  if (!b.Make(memory, plans->bytes)) return 1;
  auto copy = [&](const kvwire::TransferPlan& plan) {
    for (const kvwire::GroupPlan& g : plan.groups) {
      for (const kvwire::ByteRange& r : g.ranges)
        std::memcpy(b.dst + r.dst, b.src + r.src, r.length);
    }
  };
  const uint64_t copies = o.iterations > 0 ? o.iterations : 20;
  for (const kvwire::TransferPlan& plan : plans->plans) copy(plan);  // warm-up: every slot once
  std::vector<double> ms;
  for (uint64_t i = 0; i < copies; ++i) {
    const auto start = std::chrono::steady_clock::now();
    copy(plans->plans[i % plans->plans.size()]);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("memcpy-kv %s %llu %s %.4f %.4f\n", o.layout.c_str(),
              static_cast<unsigned long long>(plans->plans[0].bytes), memory.c_str(),
              ms[ms.size() / 2], ms[0]);
  return 0;
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
  if (o.workload == kvwire::perf::Workload::kKv) return KvFloor(o, memory);
  const uint64_t bytes = kvwire::perf::RawRegionBytes(o);
  FloorBuffers buffers;
  if (!buffers.Make(memory, bytes)) return 1;
  std::byte* const src = buffers.src;
  std::byte* const dst = buffers.dst;
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
