// CPU of one whole engine Transfer over rdma, without a device (issue 24): the verbs calls of
// transport/rdma go to the fake table (tests/rdma/fake/fake_verbs.h), which accepts every post
// and completes it at once without touching memory (a NIC would move the bytes), so what is
// counted is kvwire's own work for the page set: Engine::Transfer (planning, merging, lanes),
// the rdma channel (resolving keys, building and chaining WRs under the send window,
// ibv_post_send), the event thread (polling the CQ, completing lanes) and Engine::Wait.
//
// The page set is the one of kvwire-request-bench: a DeepSeek-V4-Pro request of --tokens
// tokens (8192: 3,096 pages, 51.8 MB) over the connector tests' simulated KV cache with free
// blocks fragmented in runs of 1..--max-run, planned with PlanTransfer; one Transfer moves all
// of it (READ: decode pulls from prefill; WRITE: prefill pushes to decode).
//
//   build/perf/kvwire-rdma-transfer-bench [--layout dsv4-pro] [--tokens 8192] [--n 200]
//       [--warmup 20] [--modes read,write] [--qps 4]
//
// Columns: pages (ops before merging), ops (after), WRs and ibv_post_send calls per Transfer,
// CPU us per Transfer for the whole process (both engines, every thread: user+sys from
// getrusage) and for the calling thread alone (Transfer + Wait), wall us, allocations per
// Transfer. The fake's own work (a few ns per WR) is inside the process figure.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "perf/cpu/counting_alloc.h"
#include "tests/connector/kv_sim.h"
#include "tests/rdma/fake/fake_verbs.h"

namespace {

struct Config {
  std::string layout = "dsv4-pro";
  uint64_t tokens = 8192;
  uint64_t n = 200;
  uint64_t warmup = 20;
  uint64_t max_run = 8;
  int qps = 4;
  std::vector<std::string> modes = {"read", "write"};

  std::string Preset() const {
    if (layout == "dsv4-pro") return "deepseek-v4-pro";
    if (layout == "dsv4-flash") return "deepseek-v4-flash";
    return layout;
  }
  uint64_t Blocks() const { return 2 * (tokens / 64) + 8; }
};

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "kvwire-rdma-transfer-bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

double ProcessCpuUs() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 + ru.ru_utime.tv_usec +
         ru.ru_stime.tv_usec;
}

double ThreadCpuUs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

std::string Load() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "?";
  char buf[128] = {0};
  const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string s(buf, got);
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

struct PageSet {
  std::vector<kvwire::ByteRange> ranges;  // offsets: src = prefill buffer, dst = decode buffer
  uint64_t pages = 0, merged = 0, bytes = 0, buffer_bytes = 0;
};

// The request's pages as offsets of two KV buffers laid out from 0, the way
// kvwire-request-bench builds its bare Transfer.
PageSet MakePageSet(const Config& c) {
  auto prefill = kvwire::testing::KvCache::Create(c.Preset(), c.Blocks(), 2, 11);
  auto decode = kvwire::testing::KvCache::Create(c.Preset(), c.Blocks(), 2, 12);
  if (!prefill.ok()) Die("KV cache", prefill.status());
  if (!decode.ok()) Die("KV cache", decode.status());
  (*prefill)->FragmentInRuns(c.max_run);
  (*decode)->FragmentInRuns(c.max_run);
  auto p = (*prefill)->Allocate("r", c.tokens);
  auto d = (*decode)->Allocate("r", c.tokens);
  if (!p.ok() || !d.ok()) Die("allocate", p.ok() ? d.status() : p.status());
  absl::StatusOr<kvwire::Layout> layout = kvwire::testing::MakeLayout(c.Preset());
  if (!layout.ok()) Die("layout", layout.status());
  PageSet set;
  set.buffer_bytes = kvwire::AssignBacking(&*layout, 0, c.Blocks(), 2);
  auto plan = kvwire::PlanTransfer(*layout, *p, *layout, *d, c.tokens);
  if (!plan.ok()) Die("PlanTransfer", plan.status());
  for (const kvwire::GroupPlan& g : plan->groups) {
    set.ranges.insert(set.ranges.end(), g.ranges.begin(), g.ranges.end());
  }
  set.pages = plan->ops_before_merge;
  set.merged = plan->ops_after_merge;
  set.bytes = plan->bytes;
  return set;
}

void RunMode(const Config& c, const PageSet& set, const std::string& mode) {
  kvwire::testing::ScopedFakeVerbs fake;
  const bool write = mode == "write";
  kvwire::EngineOptions o;
  o.transport = "rdma";
  o.rdma().qps_per_peer = c.qps;
  o.name = "rdma-bench-target";
  auto target = kvwire::Engine::Create(o);
  if (!target.ok()) Die("target engine", target.status());
  o.name = "rdma-bench-initiator";
  auto initiator = kvwire::Engine::Create(o);
  if (!initiator.ok()) Die("initiator engine", initiator.status());
  // Never touched (the fake moves nothing): only registered, so no page is ever faulted in.
  auto remote_mem = std::make_unique_for_overwrite<std::byte[]>(set.buffer_bytes);
  auto local_mem = std::make_unique_for_overwrite<std::byte[]>(set.buffer_bytes);
  kvwire::RegionOptions exported;
  exported.export_to_all_peers = true;
  auto remote = (*target)->RegisterMemory(remote_mem.get(), set.buffer_bytes, exported);
  if (!remote.ok()) Die("register", remote.status());
  auto local = (*initiator)->RegisterMemory(local_mem.get(), set.buffer_bytes);
  if (!local.ok()) Die("register", local.status());
  auto peer = (*initiator)->Connect((*target)->address());
  if (!peer.ok()) Die("connect", peer.status());
  if (auto s = (*initiator)->WaitForRemoteRegion(*peer, *remote, absl::Seconds(30)); !s.ok()) {
    Die("remote region", s);
  }
  // write: prefill (local) -> decode (remote); read: decode (local) <- prefill (remote).
  std::vector<kvwire::Op> ops;
  ops.reserve(set.ranges.size());
  for (const kvwire::ByteRange& r : set.ranges) {
    ops.push_back(write ? kvwire::Op{*local, r.src, *remote, r.dst, r.length}
                        : kvwire::Op{*local, r.dst, *remote, r.src, r.length});
  }
  const kvwire::OpKind kind = write ? kvwire::OpKind::kWrite : kvwire::OpKind::kRead;
  auto one = [&] {
    auto id = (*initiator)->Transfer(*peer, kind, ops);
    if (!id.ok()) Die("Transfer", id.status());
    if (auto s = (*initiator)->Wait(*id, absl::Seconds(30)); !s.ok()) Die("Wait", s);
  };
  for (uint64_t i = 0; i < c.warmup; ++i) one();
  const uint64_t wrs0 = fake.counters().send_wrs, posts0 = fake.counters().post_send_calls;
  const uint64_t news0 = kvwire::perf::cpu::ProcessAllocs().news;
  std::vector<double> wall;
  const double process0 = ProcessCpuUs(), thread0 = ThreadCpuUs();
  for (uint64_t i = 0; i < c.n; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    one();
    wall.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  const double process_us = (ProcessCpuUs() - process0) / c.n;
  const double thread_us = (ThreadCpuUs() - thread0) / c.n;
  const double news = static_cast<double>(kvwire::perf::cpu::ProcessAllocs().news - news0) / c.n;
  const double wrs = static_cast<double>(fake.counters().send_wrs - wrs0) / c.n;
  const double posts = static_cast<double>(fake.counters().post_send_calls - posts0) / c.n;
  std::sort(wall.begin(), wall.end());
  std::printf("%-10s %-6s %6llu %6llu %8.1f %7.1f %6.1f %10.1f %10.1f %9.1f %8.1f\n",
              c.layout.c_str(), mode.c_str(), static_cast<unsigned long long>(set.pages),
              static_cast<unsigned long long>(set.merged), set.bytes / 1e6, wrs, posts, process_us,
              thread_us, wall[wall.size() / 2], news);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    bool ok = true;
    if (k == "--layout") {
      c.layout = v;
    } else if (k == "--tokens") {
      ok = absl::SimpleAtoi(v, &c.tokens);
    } else if (k == "--n") {
      ok = absl::SimpleAtoi(v, &c.n) && c.n > 0;
    } else if (k == "--warmup") {
      ok = absl::SimpleAtoi(v, &c.warmup);
    } else if (k == "--max-run") {
      ok = absl::SimpleAtoi(v, &c.max_run) && c.max_run > 0;
    } else if (k == "--qps") {
      ok = absl::SimpleAtoi(v, &c.qps);
    } else if (k == "--modes") {
      c.modes = absl::StrSplit(v, ',');
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "kvwire-rdma-transfer-bench: bad option %s %s\n", k.c_str(), v.c_str());
      return 2;
    }
  }
  const PageSet set = MakePageSet(c);
  std::printf(
      "# kvwire-rdma-transfer-bench: one engine Transfer of a %s %llu-token request over rdma "
      "with fake verbs (no device, no copy), %d QPs, %llu Transfers after %llu warm-up; load "
      "%s\n",
      c.layout.c_str(), static_cast<unsigned long long>(c.tokens), c.qps,
      static_cast<unsigned long long>(c.n), static_cast<unsigned long long>(c.warmup),
      Load().c_str());
  std::printf("%-10s %-6s %6s %6s %8s %7s %6s %10s %10s %9s %8s\n", "layout", "mode", "pages",
              "ops", "MB", "WRs", "posts", "proc CPU", "thr CPU", "wall p50", "allocs");
  for (const std::string& mode : c.modes) RunMode(c, set, mode);
  std::printf("# CPU and wall in us per Transfer (decimal MB); load after: %s\n", Load().c_str());
  return 0;
}
