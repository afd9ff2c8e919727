// The model's KV-cache operations on a KvExecutor: what Model::Forward runs instead of its CPU
// code when the cache lives in executor memory (kv_cache.h, KvDevice::kGpu / kHostKernels).
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KV_OPS_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KV_OPS_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"

#include "examples/dsv4/model/gpu/attention_math.h"
#include "examples/dsv4/model/gpu/kv_executor.h"

namespace dsv4::gpu {

// The KV-cache write: slots.size() records from `src` (host, 512 floats each) into the pages
// of one layer of one group, whose block b starts at layer_base + b * page_bytes and holds
// `entries` records; slot = block * entries + index (negative: skipped, as padding).
absl::Status EncodeRecords(KvExecutor& executor, uint8_t* layer_base, uint64_t page_bytes,
                           uint32_t entries, uint64_t num_blocks, const float* src,
                           std::span<const int64_t> slots);

// Attention of keys.size() queries with `num_heads` heads each (q: host, [t][h][512]) over
// their keys (keys[t], in the order the softmax and the sum take them) in the cache at
// `cache`, with per-head sink logits `sinks`: writes out[t][h][512] (host), as
// dsv4::AttendWithSink does for each (t, h).
absl::Status Attend(KvExecutor& executor, const uint8_t* cache, const float* q, uint32_t num_heads,
                    const std::vector<std::vector<KeyRef>>& keys, float scale, const float* sinks,
                    float* out);

}  // namespace dsv4::gpu

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KV_OPS_H_
