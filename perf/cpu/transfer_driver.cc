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
//                          [--op write|read]
#include <sys/resource.h>

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

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  std::unique_ptr<kvwire::Engine> engines[2];
  kvwire::ShareableBuffer buffers[2];
  kvwire::RegionId regions[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    kvwire::EngineOptions o;
    o.name = i == 0 ? "driver-initiator" : "driver-target";
    o.transport = a.transport;
    absl::StatusOr<std::unique_ptr<kvwire::Engine>> e = kvwire::Engine::Create(o);
    if (!e.ok()) Die(absl::StrCat("engine: ", e.status().message()));
    engines[i] = *std::move(e);
    absl::StatusOr<kvwire::ShareableBuffer> b =
        kvwire::ShareableBuffer::Create(a.size, "kvwire-transfer-driver");
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
