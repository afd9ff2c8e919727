// CPU cost of kvwire's own work-request building path, without a device: resolve -> PlanWrs
// -> FillChain under send-window admission, as ClientQp::PumpLocked runs it, for a
// DeepSeek-V4-like WRITE lane (thousands of 1.7-37 KB pieces). Reports ns per op (piece) and,
// as counters, ibv_post_send calls and signalled completions per 1000 ops.
//
//   build-rdma/tests/rdma/kvwire_bench_rdma_post --benchmark_min_time=0.5
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "transport/rdma/rdma_plan.h"

namespace kvwire::transport::rdma {
namespace {

struct Pattern {
  std::vector<ResolvedOp> ops;
};

// `pieces` pieces of 1.7-37 KB; remote ranges scattered over blocks of a KV pool (so they
// rarely merge), local ranges packed (one staging region).
Pattern DeepSeekLike(int pieces, bool remote_contiguous) {
  std::mt19937_64 rng(42);
  Pattern p;
  uint64_t local = 0x10000000, remote = 0x7f0000000000;
  for (int i = 0; i < pieces; ++i) {
    const uint64_t len = 1700 + rng() % (37000 - 1700);
    p.ops.push_back(ResolvedOp{local, 0x1111, remote, 0x2222, len});
    local += len + (remote_contiguous ? 64 : 0);
    remote += remote_contiguous ? len : len + 4096 * (1 + rng() % 8);
  }
  return p;
}

void BM_BuildAndChain(benchmark::State& state) {
  const int pieces = static_cast<int>(state.range(0));
  const bool contiguous = state.range(1) != 0;
  const uint32_t depth = 256, interval = 64, max_sge = 16, max_inline = 128;
  Pattern pattern = DeepSeekLike(pieces, contiguous);
  WrPlan plan;
  std::vector<ibv_send_wr> scratch(depth);
  uint64_t posts = 0, signalled = 0, wrs = 0;
  for (auto _ : state) {
    plan.clear();
    PlanWrs(pattern.ops.data(), pattern.ops.size(), WrLimits{max_sge, 1ull << 30}, &plan);
    SendWindow window(depth);
    size_t next = 0;
    while (next < plan.wrs.size()) {
      const uint32_t k =
          std::min<uint32_t>(window.free(), static_cast<uint32_t>(plan.wrs.size() - next));
      const uint64_t seq = window.Reserve(k);
      signalled +=
          FillChain(plan, next, k, IBV_WR_RDMA_WRITE, max_inline, interval, seq, 0, scratch.data());
      benchmark::DoNotOptimize(scratch.data());
      ++posts;  // one ibv_post_send per chain
      wrs += k;
      next += k;
      window.Complete(seq + k - 1);  // the device retires the chain
    }
  }
  const double ops = static_cast<double>(state.iterations()) * pieces;
  state.SetItemsProcessed(static_cast<int64_t>(ops));
  state.counters["ns_per_op"] =
      benchmark::Counter(ops, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["posts_per_1k_ops"] = 1000.0 * posts / ops;
  state.counters["signalled_per_1k_ops"] = 1000.0 * signalled / ops;
  state.counters["wrs_per_1k_ops"] = 1000.0 * wrs / ops;
}
BENCHMARK(BM_BuildAndChain)
    ->ArgNames({"pieces", "remote_contig"})
    ->Args({1000, 0})
    ->Args({4000, 0})
    ->Args({4000, 1});

}  // namespace
}  // namespace kvwire::transport::rdma

BENCHMARK_MAIN();
