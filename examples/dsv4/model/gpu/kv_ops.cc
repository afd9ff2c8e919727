// KV-cache write and attention on a KvExecutor.
#include "examples/dsv4/model/gpu/kv_ops.h"

#include <tuple>

#include "absl/strings/str_cat.h"

#include "examples/dsv4/model/gpu/host_driver.h"

namespace dsv4::gpu {
namespace {

// Sub-allocations of one executor buffer, each aligned for any of the argument types.
class Arena {
 public:
  template <typename T>
  uint64_t Reserve(uint64_t count) {
    const uint64_t at = (size_ + 255) / 256 * 256;
    size_ = at + count * sizeof(T);
    return at;
  }
  uint64_t size() const { return size_; }

 private:
  uint64_t size_ = 0;
};

}  // namespace

absl::Status EncodeRecords(KvExecutor& executor, uint8_t* layer_base, uint64_t page_bytes,
                           uint32_t entries, uint64_t num_blocks, const float* src,
                           std::span<const int64_t> slots) {
  if (slots.empty()) return absl::OkStatus();
  const uint64_t n = slots.size();
  Arena arena;
  const uint64_t src_at = arena.Reserve<float>(n * kHeadDim);
  const uint64_t slots_at = arena.Reserve<int64_t>(n);
  absl::StatusOr<std::unique_ptr<KvExecutor::Buffer>> buffer = executor.Allocate(arena.size());
  if (!buffer.ok()) return buffer.status();
  uint8_t* base = static_cast<uint8_t*>((*buffer)->data());
  if (absl::Status s = executor.Upload(base + src_at, src, n * kHeadDim * sizeof(float)); !s.ok()) {
    return s;
  }
  if (absl::Status s = executor.Upload(base + slots_at, slots.data(), n * sizeof(int64_t));
      !s.ok()) {
    return s;
  }
  kvwire::gpu::KvEncodeArgs args;
  args.src = reinterpret_cast<const float*>(base + src_at);
  args.src_stride = kHeadDim;
  args.slots = reinterpret_cast<const int64_t*>(base + slots_at);
  args.cache = layer_base;
  args.page_bytes = page_bytes;
  args.num_slots = num_blocks * entries;
  args.block_size = entries;
  args.num_tokens = static_cast<uint32_t>(n);
  return executor.EncodeKvRecords(args);
}

absl::Status Attend(KvExecutor& executor, const uint8_t* cache, const float* q, uint32_t num_heads,
                    const std::vector<std::vector<KeyRef>>& keys, float scale, const float* sinks,
                    float* out) {
  const uint32_t T = static_cast<uint32_t>(keys.size());
  if (T == 0) return absl::OkStatus();
  std::vector<uint32_t> begin{0}, query;
  std::vector<KeyRef> refs;
  for (uint32_t t = 0; t < T; ++t) {
    refs.insert(refs.end(), keys[t].begin(), keys[t].end());
    query.insert(query.end(), keys[t].size(), t);
    begin.push_back(static_cast<uint32_t>(refs.size()));
  }
  const uint64_t K = refs.size(), H = num_heads;
  const uint64_t qo_floats = uint64_t{T} * H * kHeadDim;
  Arena arena;
  const uint64_t q_at = arena.Reserve<float>(qo_floats);
  const uint64_t refs_at = arena.Reserve<KeyRef>(K);
  const uint64_t begin_at = arena.Reserve<uint32_t>(T + 1);
  const uint64_t query_at = arena.Reserve<uint32_t>(K);
  const uint64_t logits_at = arena.Reserve<float>(K * H);
  const uint64_t probs_at = arena.Reserve<float>(K * H);
  const uint64_t out_at = arena.Reserve<float>(qo_floats);
  absl::StatusOr<std::unique_ptr<KvExecutor::Buffer>> buffer = executor.Allocate(arena.size());
  if (!buffer.ok()) return buffer.status();
  uint8_t* base = static_cast<uint8_t*>((*buffer)->data());
  for (const auto& [at, src, bytes] :
       {std::tuple<uint64_t, const void*, uint64_t>{q_at, q, qo_floats * sizeof(float)},
        {refs_at, refs.data(), K * sizeof(KeyRef)},
        {begin_at, begin.data(), (T + 1) * sizeof(uint32_t)},
        {query_at, query.data(), K * sizeof(uint32_t)}}) {
    if (absl::Status s = executor.Upload(base + at, src, bytes); !s.ok()) return s;
  }
  AttentionArgs args;
  args.cache = cache;
  args.q = reinterpret_cast<const float*>(base + q_at);
  args.keys = reinterpret_cast<const KeyRef*>(base + refs_at);
  args.key_begin = reinterpret_cast<const uint32_t*>(base + begin_at);
  args.key_query = reinterpret_cast<const uint32_t*>(base + query_at);
  args.logits = reinterpret_cast<float*>(base + logits_at);
  args.probs = reinterpret_cast<const float*>(base + probs_at);
  args.out = reinterpret_cast<float*>(base + out_at);
  args.scale = scale;
  args.num_queries = T;
  args.num_heads = num_heads;
  args.num_keys = static_cast<uint32_t>(K);
  if (absl::Status s = executor.AttentionLogits(args); !s.ok()) return s;
  // Step 2 on the host (attention_math.h says why).
  std::vector<float> logits(K * H), probs(K * H);
  if (absl::Status s = executor.Download(logits.data(), args.logits, K * H * sizeof(float));
      !s.ok()) {
    return s;
  }
  SoftmaxWithSink(logits.data(), begin.data(), T, num_heads, sinks, probs.data());
  if (absl::Status s = executor.Upload(base + probs_at, probs.data(), K * H * sizeof(float));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = executor.AttentionOutput(args); !s.ok()) return s;
  return executor.Download(out, args.out, qo_floats * sizeof(float));
}

}  // namespace dsv4::gpu
