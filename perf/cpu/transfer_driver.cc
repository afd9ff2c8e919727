// kvwire-transfer-driver: the engine's cost per Transfer outside the copy. Two engines in this
// process, connected over shm (or tcp), and N transfers of ONE op each (Transfer + Wait, one at
// a time) after a warm-up. Prints, for the measured transfers:
//   - allocations per transfer (counting operator new/delete of this binary): on the calling
//     thread, and in the whole process (engine, transport and control threads included);
//   - CPU per transfer of the calling thread (CLOCK_THREAD_CPUTIME_ID) and of the process
//     (getrusage RUSAGE_SELF, all threads), and wall time per transfer.
// kvwire-transfer-driver-plain is the same without the counting allocator (so that callgrind
// counts the library's own allocator calls, not the counters' wrappers).
// The measured loop is the function kvwire_cpu_measured_loop, so that
// `valgrind --tool=callgrind --collect-atstart=no --toggle-collect=kvwire_cpu_measured_loop`
// counts exactly the measured transfers (perf/cpu/callgrind.sh does this).
//
//   kvwire-transfer-driver [--n 2000] [--warmup 200] [--size 4096] [--transport shm|tcp]
//                          [--op write|read] [--pool-mib M [--rounds 9]] [--first-touch N]
//
// --first-touch N: the first N transfers after connect (no warm-up), each timed alone, over
// the same --size bytes at offset 0 of both regions: what the first requests through a new
// mapping of the peer's region cost against later ones (issue 24: first within 1.5x of the
// tenth). Prints each transfer's wall time and first/last. Timings: quote with the load.
//
// --pool-mib M: the pool pattern of kvwire-perf/make compare instead (blocks of --size in the
// random order of perf/buffer_plan over an M MiB pool on each side), three ways interleaved in
// --rounds rounds of --n blocks each, so the machine's load hits all three alike:
//   engine        one-op Transfers (Transfer + Wait) between the two engines' memfd pools;
//   memcpy-memfd  memcpy between the same two memfd pools (this process's own mappings);
//   memcpy-anon   memcpy between two anonymous (std::vector) pools, what kvwire-memcpy-floor
//                 copies;
//   memcpy-popmap memcpy into (READ: from) a second mapping of the target's memfd made as the
//                 shm transport maps a peer region (MAP_SHARED | MAP_POPULATE), no engine.
// --same-blocks 1: every arm and round uses the same blocks (after the warm-up round every
// page was touched through every mapping), to tell first touches from steady state.
// Each arm takes fresh blocks of the permutation (none is cache-warm for another). Prints the
// median GB/s of each arm and their ratios, and the minor page faults inside the timed copies.
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <time.h>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "kvwire/engine.h"
#include "kvwire/memory.h"
#include "perf/buffer_plan.h"
#ifdef KVWIRE_COUNT_ALLOCS
#include "perf/cpu/counting_alloc.h"
#endif

namespace {

struct Args {
  uint64_t n = 2000;
  uint64_t warmup = 200;
  uint64_t size = 4096;
  kvwire::TransportKind transport = kvwire::TransportKind::kShm;
  kvwire::OpKind op = kvwire::OpKind::kWrite;
  uint64_t pool_mib = 0;  // > 0: the pool comparison
  uint64_t rounds = 9;
  bool same_blocks = false;  // every arm and round reuses the same blocks
  uint64_t first_touch = 0;  // > 0: time the first N transfers after connect, no warm-up
};

struct Loop {
  kvwire::Engine* engine;
  kvwire::PeerId peer;
  kvwire::OpKind op;
  kvwire::Op one;
  uint64_t count;
  absl::Status status;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "kvwire-transfer-driver: %s\n", what.c_str());
  std::exit(1);
}

double ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

double ProcessCpuNs() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e9 +
         (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e3;
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    bool ok = true;
    if (k == "--n") {
      ok = absl::SimpleAtoi(v, &a.n) && a.n > 0;
    } else if (k == "--warmup") {
      ok = absl::SimpleAtoi(v, &a.warmup);
    } else if (k == "--size") {
      ok = absl::SimpleAtoi(v, &a.size) && a.size > 0 && a.size <= (64u << 20);
    } else if (k == "--transport") {
      absl::StatusOr<kvwire::TransportKind> t = kvwire::ParseTransportKind(v);
      ok = t.ok() && (*t == kvwire::TransportKind::kShm || *t == kvwire::TransportKind::kTcp);
      if (ok) a.transport = *t;
    } else if (k == "--pool-mib") {
      ok = absl::SimpleAtoi(v, &a.pool_mib) && a.pool_mib <= (64u << 10);
    } else if (k == "--same-blocks") {
      ok = v == "0" || v == "1";
      a.same_blocks = v == "1";
    } else if (k == "--first-touch") {
      ok = absl::SimpleAtoi(v, &a.first_touch) && a.first_touch <= 1000;
    } else if (k == "--rounds") {
      ok = absl::SimpleAtoi(v, &a.rounds) && a.rounds > 0;
    } else if (k == "--op") {
      ok = v == "write" || v == "read";
      a.op = v == "read" ? kvwire::OpKind::kRead : kvwire::OpKind::kWrite;
    } else {
      ok = false;
    }
    if (!ok) Die(absl::StrCat("bad option ", k, " ", v));
  }
  if (argc % 2 == 0) Die(absl::StrCat("option ", argv[argc - 1], " needs a value"));
  return a;
}

}  // namespace

// Not static and not inlined: callgrind's --toggle-collect names it.
extern "C" __attribute__((noinline)) void kvwire_cpu_measured_loop(Loop* loop) {
  for (uint64_t i = 0; i < loop->count; ++i) {
    absl::StatusOr<kvwire::TransferId> id =
        loop->engine->Transfer(loop->peer, loop->op, {&loop->one, 1});
    if (!id.ok()) {
      loop->status = id.status();
      return;
    }
    if (absl::Status s = loop->engine->Wait(*id, absl::Seconds(30)); !s.ok()) {
      loop->status = s;
      return;
    }
  }
}

namespace {

long MinorFaults() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int PoolComparison(const Args& a, kvwire::Engine& engine, kvwire::PeerId peer,
                   const kvwire::RegionId regions[2], const kvwire::ShareableBuffer buffers[2]) {
  const uint64_t bytes = buffers[0].size();
  std::vector<std::byte> anon_src(bytes, std::byte{1}), anon_dst(bytes, std::byte{2});
  const kvwire::perf::BufferPlan plan(kvwire::perf::Pattern::kPool, 1, a.size, bytes);
  const bool write = a.op == kvwire::OpKind::kWrite;
  // Source and destination of block i for the memcpy arms, as the engine copies it: WRITE
  // local -> remote, READ remote -> local (buffers[0] is local, buffers[1] the target's).
  auto copy = [&](std::byte* local, std::byte* remote, uint64_t i) {
    const uint64_t lo = plan.LocalOffset(0, i), ro = plan.RemoteOffset(0, i);
    if (write) {
      std::memcpy(remote + ro, local + lo, a.size);
    } else {
      std::memcpy(local + lo, remote + ro, a.size);
    }
  };
  // A second mapping of the target's memfd made as the shm transport maps a peer's region
  // (MAP_SHARED | MAP_POPULATE, transport/shm/mapping.cc), for memcpy without the engine.
  void* second =
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, buffers[1].fd(), 0);
  if (second == MAP_FAILED) Die("mmap of the target's memfd failed");
  std::byte* populated = static_cast<std::byte*>(second);
  std::vector<double> gbs[4];
  long faults[4] = {0, 0, 0, 0};
  uint64_t next = 0;
  for (uint64_t round = 0; round <= a.rounds; ++round) {  // round 0: warm-up, not recorded
    for (int arm = 0; arm < 4; ++arm) {
      const uint64_t first = a.same_blocks ? 0 : next;
      next += a.n;
      const long f0 = MinorFaults();
      const auto t0 = std::chrono::steady_clock::now();
      for (uint64_t i = first; i < first + a.n; ++i) {
        if (arm == 0) {
          const kvwire::Op op{regions[0], plan.LocalOffset(0, i), regions[1],
                              plan.RemoteOffset(0, i), a.size};
          absl::StatusOr<kvwire::TransferId> id = engine.Transfer(peer, a.op, {&op, 1});
          if (!id.ok()) Die(absl::StrCat("transfer: ", id.status().message()));
          if (absl::Status s = engine.Wait(*id, absl::Seconds(30)); !s.ok()) {
            Die(absl::StrCat("transfer: ", s.message()));
          }
        } else if (arm == 1) {
          copy(buffers[0].data(), buffers[1].data(), i);
        } else if (arm == 3) {
          copy(buffers[0].data(), populated, i);
        } else {
          copy(anon_src.data(), anon_dst.data(), i);
        }
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (round > 0) {
        gbs[arm].push_back(static_cast<double>(a.n * a.size) / s / 1e9);
        faults[arm] += MinorFaults() - f0;
      }
    }
  }
  munmap(second, bytes);
  const char* names[4] = {"engine", "memcpy-memfd", "memcpy-anon", "memcpy-popmap"};
  std::printf(
      "# pool comparison: %s of %llu-byte blocks in random order over a %llu MiB pool "
      "per side, %llu rounds of %llu blocks per arm, interleaved (decimal GB/s)\n",
      write ? "WRITE" : "READ", static_cast<unsigned long long>(a.size),
      static_cast<unsigned long long>(a.pool_mib), static_cast<unsigned long long>(a.rounds),
      static_cast<unsigned long long>(a.n));
  for (int arm = 0; arm < 4; ++arm) {
    std::printf("%-13s median %.3f GB/s (min %.3f, max %.3f), %ld minor faults while timed\n",
                names[arm], Median(gbs[arm]), *std::min_element(gbs[arm].begin(), gbs[arm].end()),
                *std::max_element(gbs[arm].begin(), gbs[arm].end()), faults[arm]);
  }
  std::printf(
      "ratio engine/memcpy-memfd %.2f, engine/memcpy-anon %.2f, memfd/anon %.2f, "
      "popmap/memfd %.2f\n",
      Median(gbs[0]) / Median(gbs[1]), Median(gbs[0]) / Median(gbs[2]),
      Median(gbs[1]) / Median(gbs[2]), Median(gbs[3]) / Median(gbs[1]));
  return 0;
}

int FirstTouch(const Args& a, kvwire::Engine& engine, kvwire::PeerId peer,
               const kvwire::RegionId regions[2]) {
  const kvwire::Op op{regions[0], 0, regions[1], 0, a.size};
  std::vector<double> us;
  for (uint64_t i = 0; i < a.first_touch; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<kvwire::TransferId> id = engine.Transfer(peer, a.op, {&op, 1});
    if (!id.ok()) Die(absl::StrCat("transfer: ", id.status().message()));
    if (absl::Status s = engine.Wait(*id, absl::Seconds(60)); !s.ok()) {
      Die(absl::StrCat("transfer: ", s.message()));
    }
    us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("# first-touch: the first %llu %s transfers of %llu bytes after connect (us):",
              static_cast<unsigned long long>(a.first_touch),
              a.op == kvwire::OpKind::kWrite ? "WRITE" : "READ",
              static_cast<unsigned long long>(a.size));
  for (double u : us) std::printf(" %.0f", u);
  std::printf("\nfirst/last %.2f\n", us.front() / us.back());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  std::unique_ptr<kvwire::Engine> engines[2];
  kvwire::ShareableBuffer buffers[2];
  kvwire::RegionId regions[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    kvwire::EngineOptions o;
    o.name = i == 0 ? "driver-initiator" : "driver-target";
    o.transport = kvwire::TransportKindName(a.transport);
    absl::StatusOr<std::unique_ptr<kvwire::Engine>> e = kvwire::Engine::Create(o);
    if (!e.ok()) Die(absl::StrCat("engine: ", e.status().message()));
    engines[i] = *std::move(e);
    absl::StatusOr<kvwire::ShareableBuffer> b = kvwire::ShareableBuffer::Create(
        std::max<uint64_t>(a.size, a.pool_mib << 20), "kvwire-transfer-driver");
    if (!b.ok()) Die(absl::StrCat("buffer: ", b.status().message()));
    buffers[i] = *std::move(b);
    std::memset(buffers[i].data(), i + 1, buffers[i].size());  // touched: no page faults later
    kvwire::RegionOptions ro;
    ro.export_to_all_peers = i == 1;
    absl::StatusOr<kvwire::RegionId> r =
        engines[i]->RegisterMemory(buffers[i].data(), buffers[i].size(), ro);
    if (!r.ok()) Die(absl::StrCat("register: ", r.status().message()));
    regions[i] = *r;
  }
  absl::StatusOr<kvwire::PeerId> peer = engines[0]->Connect(engines[1]->address());
  if (!peer.ok()) Die(absl::StrCat("connect: ", peer.status().message()));
  if (absl::Status s = engines[0]->WaitForRemoteRegion(*peer, regions[1], absl::Seconds(10));
      !s.ok()) {
    Die(absl::StrCat("remote region: ", s.message()));
  }
  std::string transport;
  for (const kvwire::PeerInfo& p : engines[0]->Peers()) {
    if (p.id == *peer) transport = p.transport;
  }

  if (a.pool_mib > 0) return PoolComparison(a, *engines[0], *peer, regions, buffers);
  if (a.first_touch > 0) return FirstTouch(a, *engines[0], *peer, regions);

  Loop loop{
      engines[0].get(), *peer,           a.op, kvwire::Op{regions[0], 0, regions[1], 0, a.size},
      a.warmup,         absl::OkStatus()};
  kvwire_cpu_measured_loop(&loop);  // warm-up: first-use allocations and lazy setup
  if (!loop.status.ok()) Die(absl::StrCat("warm-up transfer: ", loop.status.message()));

  loop.count = a.n;
#ifdef KVWIRE_COUNT_ALLOCS
  const kvwire::perf::cpu::AllocCounts thread0 = kvwire::perf::cpu::ThreadAllocs();
  const kvwire::perf::cpu::AllocCounts process0 = kvwire::perf::cpu::ProcessAllocs();
#endif
  const double tcpu0 = ThreadCpuNs(), pcpu0 = ProcessCpuNs();
  const auto t0 = std::chrono::steady_clock::now();
  kvwire_cpu_measured_loop(&loop);
  const auto t1 = std::chrono::steady_clock::now();
  const double tcpu1 = ThreadCpuNs(), pcpu1 = ProcessCpuNs();
#ifdef KVWIRE_COUNT_ALLOCS
  const kvwire::perf::cpu::AllocCounts thread = kvwire::perf::cpu::ThreadAllocs() - thread0;
  const kvwire::perf::cpu::AllocCounts process = kvwire::perf::cpu::ProcessAllocs() - process0;
#endif
  if (!loop.status.ok()) Die(absl::StrCat("transfer: ", loop.status.message()));

  const double n = static_cast<double>(a.n);
  std::printf(
      "# kvwire-transfer-driver: %llu transfers of one %llu-byte %s op over %s (%s), "
      "one at a time, after %llu warm-up\n",
      static_cast<unsigned long long>(a.n), static_cast<unsigned long long>(a.size),
      a.op == kvwire::OpKind::kWrite ? "WRITE" : "READ", kvwire::TransportKindName(a.transport),
      transport.c_str(), static_cast<unsigned long long>(a.warmup));
#ifdef KVWIRE_COUNT_ALLOCS
  std::printf("allocs_per_transfer_thread %.3f\n", thread.news / n);
  std::printf("frees_per_transfer_thread %.3f\n", thread.deletes / n);
  std::printf("alloc_bytes_per_transfer_thread %.1f\n", thread.bytes / n);
  std::printf("allocs_per_transfer_process %.3f\n", process.news / n);
  std::printf("frees_per_transfer_process %.3f\n", process.deletes / n);
#else
  std::printf("# allocations not counted (the -plain build, for callgrind)\n");
#endif
  std::printf("thread_cpu_ns_per_transfer %.0f\n", (tcpu1 - tcpu0) / n);
  std::printf("process_cpu_ns_per_transfer %.0f\n", (pcpu1 - pcpu0) / n);
  std::printf("wall_ns_per_transfer %.0f\n",
              std::chrono::duration<double, std::nano>(t1 - t0).count() / n);
  return 0;
}
