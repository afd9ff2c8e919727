// kvwire-demo: moves data between two processes over shm and tcp, verifies it, and prints
// bandwidth next to memcpy of the same sizes and cache state, measured in the same run.
//
//   kvwire-demo [--transports=shm,tcp] [--sizes=65536,1048576] [--total_mb=512]
//               [--pool_mb=256] [--batch=8] [--outstanding=4] [--reps=3]
//
// The target is this same binary started with --serve. Bandwidth is decimal GB/s (1e9 B/s).
// "hot" reuses one buffer on each side (what ucx_perftest and perftest do); "pool" walks a
// pool much larger than the caches (what a KV cache is).
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <signal.h>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "kvwire/engine.h"

namespace {

struct Args {
  bool serve = false;
  std::vector<std::string> transports = {"shm", "tcp"};
  std::vector<uint64_t> sizes = {64 << 10, 1 << 20};
  uint64_t total_mb = 512;
  uint64_t pool_mb = 256;
  int batch = 8;
  int outstanding = 4;
  int reps = 3;
};

bool ParseArgs(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--serve") {
      args->serve = true;
      continue;
    }
    std::vector<std::string> kv = absl::StrSplit(a, absl::MaxSplits('=', 1));
    if (kv.size() != 2) return false;
    bool ok = true;
    if (kv[0] == "--transports") {
      args->transports = absl::StrSplit(kv[1], ',', absl::SkipEmpty());
    } else if (kv[0] == "--sizes") {
      args->sizes.clear();
      for (absl::string_view s : absl::StrSplit(kv[1], ',', absl::SkipEmpty())) {
        uint64_t v = 0;
        ok = ok && absl::SimpleAtoi(s, &v) && v > 0;
        args->sizes.push_back(v);
      }
    } else if (kv[0] == "--total_mb") {
      ok = absl::SimpleAtoi(kv[1], &args->total_mb);
    } else if (kv[0] == "--pool_mb") {
      ok = absl::SimpleAtoi(kv[1], &args->pool_mb);
    } else if (kv[0] == "--batch") {
      ok = absl::SimpleAtoi(kv[1], &args->batch) && args->batch > 0;
    } else if (kv[0] == "--outstanding") {
      ok = absl::SimpleAtoi(kv[1], &args->outstanding) && args->outstanding > 0;
    } else if (kv[0] == "--reps") {
      ok = absl::SimpleAtoi(kv[1], &args->reps) && args->reps > 0;
    } else {
      ok = false;
    }
    if (!ok) return false;
  }
  return true;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvwire-demo: %s\n", s.ToString().c_str());
  return 1;
}

// Target: a pool exported read-write to every peer; serves until stdin closes.
int Serve(const Args& args) {
  auto from_env = kvwire::EngineOptions::FromEnvironment({});
  if (!from_env.ok()) return Fail(from_env.status());
  auto engine = kvwire::Engine::Create(*from_env);
  if (!engine.ok()) return Fail(engine.status());
  auto pool = kvwire::ShareableBuffer::Create(args.pool_mb << 20, "kvwire-demo-target");
  if (!pool.ok()) return Fail(pool.status());
  kvwire::RegionOptions options;
  options.export_to_all_peers = true;
  auto region = (*engine)->RegisterMemory(pool->data(), pool->size(), options);
  if (!region.ok()) return Fail(region.status());
  std::printf("%s %llu\n", (*engine)->address().c_str(), static_cast<unsigned long long>(*region));
  std::fflush(stdout);
  char c;
  while (read(STDIN_FILENO, &c, 1) > 0) {
  }
  return 0;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Pattern {
  const char* name;
  bool hot;
};

// Offsets of the i-th op: the same place (hot) or walking the pool in order (pool).
uint64_t OffsetOf(bool hot, uint64_t i, uint64_t size, uint64_t pool) {
  return hot ? 0 : (i * size) % (pool - pool % size);
}

double MemcpyGBs(std::byte* dst, const std::byte* src, uint64_t size, bool hot, uint64_t total,
                 uint64_t pool) {
  const uint64_t n = std::max<uint64_t>(1, total / size);
  const absl::Time start = absl::Now();
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t off = OffsetOf(hot, i, size, pool);
    std::memcpy(dst + off, src + off, size);
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return static_cast<double>(n * size) / seconds / 1e9;
}

absl::StatusOr<double> EngineGBs(kvwire::Engine& engine, kvwire::PeerId peer,
                                 kvwire::RegionId local, kvwire::RegionId remote,
                                 kvwire::OpKind kind, uint64_t size, bool hot, uint64_t total,
                                 uint64_t pool, int batch, int outstanding) {
  const uint64_t n = std::max<uint64_t>(batch, total / size);
  std::vector<kvwire::TransferId> inflight;
  std::vector<kvwire::Op> ops;
  const absl::Time start = absl::Now();
  for (uint64_t i = 0; i < n;) {
    ops.clear();
    for (int b = 0; b < batch && i < n; ++b, ++i) {
      const uint64_t off = OffsetOf(hot, i, size, pool);
      ops.push_back(kvwire::Op{local, off, remote, off, size});
    }
    auto id = engine.Transfer(peer, kind, ops);
    if (!id.ok()) return id.status();
    inflight.push_back(*id);
    if (static_cast<int>(inflight.size()) >= outstanding) {
      if (absl::Status s = engine.Wait(inflight.front(), absl::Seconds(60)); !s.ok()) return s;
      inflight.erase(inflight.begin());
    }
  }
  for (kvwire::TransferId id : inflight) {
    if (absl::Status s = engine.Wait(id, absl::Seconds(60)); !s.ok()) return s;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return static_cast<double>(n * size) / seconds / 1e9;
}

// Writes random bytes, reads them back into a cleared range, and compares.
absl::Status Verify(kvwire::Engine& engine, kvwire::PeerId peer, kvwire::RegionId local_id,
                    std::byte* local, kvwire::RegionId remote, uint64_t bytes) {
  std::mt19937_64 rng(bytes);
  for (uint64_t i = 0; i < bytes; ++i) local[i] = static_cast<std::byte>(rng());
  std::vector<kvwire::Op> ops;
  for (uint64_t off = 0; off < bytes; off += 40960) {
    ops.push_back(kvwire::Op{local_id, off, remote, off, std::min<uint64_t>(40960, bytes - off)});
  }
  auto w = engine.Transfer(peer, kvwire::OpKind::kWrite, ops);
  if (!w.ok()) return w.status();
  if (absl::Status s = engine.Wait(*w, absl::Seconds(60)); !s.ok()) return s;
  std::memset(local + bytes, 0, bytes);
  for (auto& op : ops) op.local_offset += bytes;
  auto r = engine.Transfer(peer, kvwire::OpKind::kRead, ops);
  if (!r.ok()) return r.status();
  if (absl::Status s = engine.Wait(*r, absl::Seconds(60)); !s.ok()) return s;
  if (std::memcmp(local, local + bytes, bytes) != 0) {
    return absl::DataLossError("read-back differs from what was written");
  }
  return absl::OkStatus();
}

int Run(const Args& args, const char* self) {
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return Fail(absl::InternalError("pipe"));
  const pid_t child = fork();
  if (child == 0) {
    dup2(to_child[0], STDIN_FILENO);
    dup2(from_child[1], STDOUT_FILENO);
    close(to_child[1]);
    close(from_child[0]);
    const std::string pool = absl::StrCat("--pool_mb=", args.pool_mb);
    execl(self, self, "--serve", pool.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  FILE* in = fdopen(from_child[0], "r");
  char line[256] = {};
  if (in == nullptr || std::fgets(line, sizeof(line), in) == nullptr) {
    return Fail(absl::InternalError("target process did not start"));
  }
  std::vector<std::string> parts = absl::StrSplit(absl::StripTrailingAsciiWhitespace(line), ' ');
  kvwire::RegionId remote = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &remote)) {
    return Fail(absl::InternalError(absl::StrCat("bad target line: ", line)));
  }
  const std::string address = parts[0];
  const uint64_t pool = args.pool_mb << 20;

  auto local_pool = kvwire::ShareableBuffer::Create(2 * pool, "kvwire-demo-initiator");
  if (!local_pool.ok()) return Fail(local_pool.status());
  std::memset(local_pool->data(), 1, local_pool->size());  // fault the pages in
  std::vector<std::byte> src(pool, std::byte{2});

  std::printf(
      "kvwire-demo: two processes (pid %d -> %d), pool %llu MiB per side, %llu MiB "
      "per measurement, batch %d ops per transfer, %d transfers outstanding,\n"
      "median of %d runs. Bandwidth in decimal GB/s (1e9 B/s).\n\n",
      getpid(), child, static_cast<unsigned long long>(args.pool_mb),
      static_cast<unsigned long long>(args.total_mb), args.batch, args.outstanding, args.reps);
  std::printf("%-9s %-5s %-9s %-7s %9s %9s %7s  %s\n", "transport", "op", "size", "memory", "GB/s",
              "memcpy", "ratio", "path");
  int status = 0;
  for (const std::string& transport : args.transports) {
    auto from_env = kvwire::EngineOptions::FromEnvironment({});
    if (!from_env.ok()) return Fail(from_env.status());
    kvwire::EngineOptions options = *std::move(from_env);
    options.transport = transport;  // checked by Engine::Create
    auto engine = kvwire::Engine::Create(options);
    if (!engine.ok()) return Fail(engine.status());
    auto local = (*engine)->RegisterMemory(local_pool->data(), local_pool->size());
    if (!local.ok()) return Fail(local.status());
    auto peer = (*engine)->Connect(address);
    if (!peer.ok()) return Fail(peer.status());
    if (absl::Status s = (*engine)->WaitForRemoteRegion(*peer, remote, absl::Seconds(10));
        !s.ok()) {
      return Fail(s);
    }
    const std::string path = (*engine)->Peers()[0].transport;
    if (absl::Status s = Verify(**engine, *peer, *local, local_pool->data(), remote, 8 << 20);
        !s.ok()) {
      std::printf("%-9s verification FAILED: %s\n", transport.c_str(), s.ToString().c_str());
      status = 1;
      continue;
    }
    for (kvwire::OpKind op : {kvwire::OpKind::kWrite, kvwire::OpKind::kRead}) {
      for (uint64_t size : args.sizes) {
        for (Pattern pattern : {Pattern{"hot", true}, Pattern{"pool", false}}) {
          std::vector<double> ours, floor;
          for (int rep = 0; rep < args.reps; ++rep) {
            // Alternate: the floor and kvwire see the same machine state.
            floor.push_back(MemcpyGBs(local_pool->data(), src.data(), size, pattern.hot,
                                      args.total_mb << 20, pool));
            auto gbs = EngineGBs(**engine, *peer, *local, remote, op, size, pattern.hot,
                                 args.total_mb << 20, pool, args.batch, args.outstanding);
            if (!gbs.ok()) return Fail(gbs.status());
            ours.push_back(*gbs);
          }
          const double m = Median(ours), f = Median(floor);
          std::printf("%-9s %-5s %-9s %-7s %9.2f %9.2f %7.2f  %s\n", transport.c_str(),
                      op == kvwire::OpKind::kRead ? "READ" : "WRITE",
                      absl::StrCat(size >> 10, " KiB").c_str(), pattern.name, m, f, m / f,
                      path.c_str());
          std::fflush(stdout);
        }
      }
    }
    kvwire::EngineStats stats = (*engine)->Stats();
    std::printf(
        "%-9s verified 8 MiB byte for byte; %llu transfers, %llu ops posted, %llu "
        "failed\n",
        transport.c_str(), static_cast<unsigned long long>(stats.transfers_succeeded),
        static_cast<unsigned long long>(stats.ops_posted),
        static_cast<unsigned long long>(stats.transfers_failed));
  }
  close(to_child[1]);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr,
                 "usage: kvwire-demo [--transports=shm,tcp] [--sizes=65536,1048576] "
                 "[--total_mb=N] [--pool_mb=N] [--batch=N] [--outstanding=N] [--reps=N]\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  return args.serve ? Serve(args) : Run(args, "/proc/self/exe");
}
