// The kv workload on the connector's layouts: both sides build the same preset layout over
// their own buffer (offsets from 0, so a range's addresses are region offsets), allocate each
// request's blocks with the asked fragmentation (prefill and decode independently, like two
// block allocators), and map the request with kvwire::PlanTransfer, as the connector does.
// One transfer is one request; `--requests` of them are in flight per thread.
#include "perf/kv_workload.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "kvwire/layout.h"
#include "perf/buffer_plan.h"
#include "perf/pump.h"
#include "perf/session.h"

namespace kvwire::perf {
namespace {

constexpr uint64_t kMaxPoolBytes = 16ull << 30;

std::string PresetName(const std::string& layout) {
  if (layout == "dsv4-pro") return "deepseek-v4-pro";
  if (layout == "dsv4-flash") return "deepseek-v4-flash";
  if (layout == "v3-mla") return "deepseek-v3";
  return layout;  // mha
}

// Block ids for the blocks of one request that move: contiguous after the previous block
// unless a draw below `fragmentation` (or a taken block) sends it elsewhere.
class BlockAllocator {
 public:
  BlockAllocator(uint64_t blocks, uint64_t seed) : used_(blocks, false), rng_(seed) {}
  int64_t Next(double fragmentation) {
    std::uniform_real_distribution<double> coin(0, 1);
    if (last_ >= 0 && coin(rng_) >= fragmentation &&
        last_ + 1 < static_cast<int64_t>(used_.size()) && !used_[last_ + 1]) {
      return Take(last_ + 1);
    }
    std::uniform_int_distribution<int64_t> any(0, static_cast<int64_t>(used_.size()) - 1);
    for (int tries = 0; tries < 1000; ++tries) {
      const int64_t b = any(rng_);
      if (!used_[b]) return Take(b);
    }
    for (size_t b = 0; b < used_.size(); ++b) {
      if (!used_[b]) return Take(static_cast<int64_t>(b));
    }
    return -1;
  }
  void Restart() { last_ = -1; }

 private:
  int64_t Take(int64_t b) {
    used_[b] = true;
    last_ = b;
    return b;
  }
  std::vector<bool> used_;
  std::mt19937_64 rng_;
  int64_t last_ = -1;
};

struct Side {
  Layout layout;
  std::vector<BlockTable> tables;  // one per request slot
};

class KvSideImpl : public KvSide {
 public:
  RegionId region() const override { return buffer_.region; }

  static absl::StatusOr<std::unique_ptr<KvSideImpl>> Make(const PerfOptions& o, Engine& engine,
                                                          bool initiator) {
    auto self = std::make_unique<KvSideImpl>();
    self->o_ = o;
    absl::StatusOr<KvPlans> plans = BuildKvPlans(o);
    if (!plans.ok()) return plans.status();
    self->bytes_ = plans->bytes;
    self->plans_ = std::move(plans->plans);
    const bool source = o.op == OpKind::kWrite ? initiator : !initiator;
    absl::StatusOr<LocalBuffer> buffer =
        MakeBuffer(engine, self->bytes_, o.check && source, !initiator);
    if (!buffer.ok()) return buffer.status();
    self->buffer_ = *std::move(buffer);
    return self;
  }

  absl::Status Serve(LineSocket& sock, const std::vector<std::string>& run,
                     absl::Duration timeout) override {
    if (run != std::vector<std::string>{"RUN", "kv", "0"}) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed RUN line for the kv workload (expected \"RUN kv 0\"): \"",
                       absl::StrJoin(run, " "), "\""));
    }
    const bool verify = o_.check && o_.op == OpKind::kWrite;
    if (verify) ClearDestinations();
    if (absl::Status s = sock.SendLine("READY"); !s.ok()) return s;
    absl::StatusOr<std::string> done = sock.ReadLine(timeout);
    if (!done.ok()) return done.status();
    if (*done != "DONE kv 0") {
      return absl::InvalidArgumentError(
          absl::StrCat("expected \"DONE kv 0\", got \"", *done, "\""));
    }
    std::string verdict = "-";
    if (verify) {
      absl::Status checked = Verify();
      verdict = checked.ok() ? "ok" : std::string(checked.message());
      std::printf(" kv request check %s\n", verdict.c_str());
      std::fflush(stdout);
    }
    return sock.SendLine(absl::StrCat("CHECK ", verdict));
  }

  absl::StatusOr<Result> Run(Engine& engine, PeerId peer, RegionId remote, LineSocket& sock,
                             ProgressLine* progress) override {
    const bool prefill_here = o_.op == OpKind::kWrite;
    std::vector<std::vector<Op>> slot_ops;
    for (const TransferPlan& plan : plans_) {
      std::vector<Op> ops;
      for (const GroupPlan& g : plan.groups) {
        for (const ByteRange& r : g.ranges) {
          ops.push_back(Op{buffer_.region, prefill_here ? r.src : r.dst, remote,
                           prefill_here ? r.dst : r.src, r.length});
        }
      }
      slot_ops.push_back(std::move(ops));
    }
    const uint64_t requests = o_.iterations > 0 ? o_.iterations : 50;
    PumpSpec spec;
    spec.kind = o_.op;
    spec.threads = o_.threads;
    spec.outstanding = o_.requests;
    spec.warmup_transfers = o_.warmup >= 0 ? o_.warmup : 2 * o_.requests;
    spec.transfers = o_.duration_s > 0 ? 0 : requests;
    spec.duration_s = o_.duration_s;
    spec.label = absl::StrCat(o_.layout, " ", o_.prompt_tokens, " tokens");
    const int per_thread = o_.requests;
    spec.make_ops = [&slot_ops, per_thread](int thread, uint64_t index, std::vector<Op>* ops) {
      const std::vector<Op>& src = slot_ops[thread * per_thread + index % per_thread];
      ops->assign(src.begin(), src.end());
    };
    const bool verify_here = o_.check && o_.op == OpKind::kRead;
    if (verify_here) ClearDestinations();
    if (absl::Status s = sock.SendLine("RUN kv 0"); !s.ok()) return s;
    absl::StatusOr<std::string> ready = sock.ReadLine(absl::Seconds(300));
    if (!ready.ok()) return ready.status();
    if (*ready != "READY") return absl::InternalError(absl::StrCat("target said ", *ready));
    const EngineStats before = engine.Stats();
    absl::StatusOr<PumpResult> pumped = Pump(engine, peer, spec, progress);
    if (!pumped.ok()) return pumped.status();
    const EngineStats after = engine.Stats();
    uint64_t all_transfers = 0;
    for (uint64_t t : pumped->transfers_per_thread) all_transfers += t;
    if (absl::Status s = sock.SendLine("DONE kv 0"); !s.ok()) return s;
    absl::StatusOr<std::string> checked = sock.ReadLine(absl::Seconds(600));
    if (!checked.ok()) return checked.status();
    Result r;
    r.check = checked->size() > 6 ? checked->substr(6) : "-";
    if (r.check == "-") r.check = "off";
    if (verify_here) {
      absl::Status s = Verify();
      r.check = s.ok() ? "ok" : std::string(s.message());
    }
    const int window = static_cast<int>(
        std::max<uint64_t>(2 * o_.requests * o_.threads, pumped->samples.size() / 20));
    Summarize(std::move(pumped->samples), pumped->seconds, window, &r);
    r.bytes = plans_[0].bytes;
    r.requests = r.transfers;
    r.requests_per_s = r.seconds > 0 ? r.transfers / r.seconds : 0;
    r.ops_before_merge = plans_[0].ops_before_merge;
    r.ops_after_merge = plans_[0].ops_after_merge;
    r.ops_posted = all_transfers == 0 ? 0 : (after.ops_posted - before.ops_posted) / all_transfers;
    r.floor_ms = MemcpyFloorMs();
    return r;
  }

 private:
  void ClearDestinations() {
    for (const TransferPlan& plan : plans_) {
      for (const GroupPlan& g : plan.groups) {
        for (const ByteRange& r : g.ranges) std::memset(buffer_.memory.data() + r.dst, 0, r.length);
      }
    }
  }

  absl::Status Verify() {
    std::vector<std::byte> expected;
    for (size_t slot = 0; slot < plans_.size(); ++slot) {
      for (const GroupPlan& g : plans_[slot].groups) {
        for (const ByteRange& r : g.ranges) {
          expected.resize(r.length);
          FillPattern(expected.data(), r.src, r.length);
          if (std::memcmp(buffer_.memory.data() + r.dst, expected.data(), r.length) != 0) {
            return absl::DataLossError(absl::StrCat(
                "kv check failed: request slot ", slot, " group ", g.group, " range (prefill ",
                r.src, " -> decode ", r.dst, ", ", r.length, " bytes) differs"));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  // memcpy of one request's ranges between two buffers of this size: the fastest of 7 (ms),
  // a floor being the least time the bytes can take.
  double MemcpyFloorMs() {
    std::vector<std::byte> other(bytes_, std::byte{3});
    std::vector<double> ms;
    for (int rep = 0; rep < 7; ++rep) {
      const TransferPlan& plan = plans_[rep % plans_.size()];
      const auto start = std::chrono::steady_clock::now();
      for (const GroupPlan& g : plan.groups) {
        for (const ByteRange& r : g.ranges) {
          std::memcpy(other.data() + r.dst, buffer_.memory.data() + r.src, r.length);
        }
      }
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
    return *std::min_element(ms.begin(), ms.end());
  }

  PerfOptions o_;
  uint64_t bytes_ = 0;
  LocalBuffer buffer_;
  std::vector<TransferPlan> plans_;
};

}  // namespace

absl::Status DumpKvRanges(const PerfOptions& options) {
  absl::StatusOr<KvPlans> planned = BuildKvPlans(options);
  if (!planned.ok()) return planned.status();
  const TransferPlan& plan = planned->plans.front();
  std::string text = absl::StrCat("kvwire-kv-ranges ", planned->bytes, " ", plan.ops_after_merge,
                                  " ", plan.bytes, " ", plan.ops_before_merge, "\n");
  for (const GroupPlan& g : plan.groups) {
    for (const ByteRange& r : g.ranges)
      absl::StrAppend(&text, r.src, " ", r.dst, " ", r.length, "\n");
  }
  std::FILE* f = std::fopen(options.dump_ranges_file.c_str(), "w");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dump-ranges: cannot write ", options.dump_ranges_file, ": ", std::strerror(errno)));
  }
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !written) {
    return absl::InternalError(
        absl::StrCat("--dump-ranges: writing ", options.dump_ranges_file, " failed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvPlans> BuildKvPlans(const PerfOptions& o) {
  absl::StatusOr<Layout> preset = PresetLayout(PresetName(o.layout));
  if (!preset.ok()) return preset.status();
  const uint64_t slots = static_cast<uint64_t>(o.threads) * o.requests;
  // Blocks one request needs in its largest group, and the bytes of one block everywhere.
  uint64_t needed = 1;
  for (const CacheGroup& g : preset->groups) {
    needed = std::max<uint64_t>(needed, SelectBlocks(g, o.prompt_tokens).logical_blocks.size());
  }
  Layout probe = *preset;
  const uint64_t per_block = std::max<uint64_t>(1, AssignBacking(&probe, 0, 1, 1));
  const uint64_t state_blocks = 2 * slots;
  uint64_t blocks = std::max<uint64_t>(2 * needed * slots, (o.pool_mib << 20) / per_block);
  probe = *preset;
  const uint64_t bytes = AssignBacking(&probe, 0, blocks, state_blocks);
  if (bytes > kMaxPoolBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv: layout ", o.layout, " with a ", o.prompt_tokens, "-token prompt and ",
                     slots, " request slots needs ", bytes >> 20, " MiB per side (over ",
                     kMaxPoolBytes >> 20, " MiB): use a shorter --prompt or fewer --requests"));
  }
  KvPlans out;
  out.bytes = bytes;
  // Both sides lay the layout out from offset 0 of their buffer.
  Side prefill, decode;
  for (int side = 0; side < 2; ++side) {
    Side& s = side == 0 ? prefill : decode;
    s.layout = *preset;
    AssignBacking(&s.layout, 0, blocks, state_blocks);
    for (const CacheGroup& g : s.layout.groups) {
      BlockAllocator alloc(g.num_blocks, 0x6b762d7065726600ull + side * 7919 + g.num_blocks);
      for (uint64_t slot = 0; slot < slots; ++slot) {
        if (s.tables.size() <= slot) s.tables.resize(slot + 1);
        const BlockSelection sel = SelectBlocks(g, o.prompt_tokens);
        std::vector<int64_t> table;
        alloc.Restart();
        for (uint64_t lb : sel.logical_blocks) {
          if (table.size() <= lb) table.resize(lb + 1, -1);
          table[lb] = alloc.Next(o.fragmentation);
        }
        s.tables[slot][g.name] = std::move(table);
      }
    }
  }
  for (uint64_t slot = 0; slot < slots; ++slot) {
    absl::StatusOr<TransferPlan> plan = PlanTransfer(
        prefill.layout, prefill.tables[slot], decode.layout, decode.tables[slot], o.prompt_tokens);
    if (!plan.ok()) return plan.status();
    out.plans.push_back(*std::move(plan));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<KvSide>> KvSide::Create(const PerfOptions& options, Engine& engine,
                                                       bool initiator) {
  absl::StatusOr<std::unique_ptr<KvSideImpl>> side = KvSideImpl::Make(options, engine, initiator);
  if (!side.ok()) return side.status();
  return std::unique_ptr<KvSide>(*std::move(side));
}

}  // namespace kvwire::perf
