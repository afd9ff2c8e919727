// The attention decode of the reference DeepSeek-V4 engine over its paged fp8 KV cache, as
// `__host__ __device__` functions shared by the GPU kernels (attention_decode.cu) and their
// host driver (host_driver.cc), so that the driver run on a machine without a GPU checks the
// very code the kernels run.
//
// One query head attends over a list of keys, each a 584-byte record (kv_record.h) in a page
// of the cache; K = V (shared-KV MQA). The split into three steps mirrors dsv4::AttendWithSink
// (ops.cc) operation by operation, so that the results are bit-identical to the CPU path:
//   1. logits[k][h] = Dot(q[h], key_k) * scale      (kernel: one thread per (key, head))
//   2. p[k][h] = softmax with the sink              (host: SoftmaxWithSink, std::exp)
//   3. out[t][h][d] = sum_k p[k][h] * key_k[d]      (kernel: one thread per (query, head, dim))
// Step 2 is n scalars per head and stays on the host: std::exp has no bit-identical device
// counterpart (device expf is not correctly rounded, and glibc's is not either), while steps
// 1 and 3, which read every key record, use only IEEE multiplies and adds in the CPU's order.
// Multiplies and adds go through MulRn/AddRn so that no compiler fuses them into an FMA (the
// CPU path runs on x86-64 without FMA). Plain C++17: nvcc and hipcc compile this header.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_GPU_ATTENTION_MATH_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_GPU_ATTENTION_MATH_H_

#include <cstdint>

#include "src/gpu/kv_record.h"

namespace dsv4::gpu {

inline constexpr uint32_t kHeadDim = kvwire::gpu::kKvInputDims;  // 512

// a * b and a + b rounded to nearest, never contracted into a fused multiply-add.
KVW_HOST_DEVICE inline float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a * b;
#endif
}
KVW_HOST_DEVICE inline float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return a + b;
#endif
}

// Where one key lives: record `index` of the page at cache + page_offset, which holds
// `entries` records (64 for SWA and c4a pages, 2 for c128a pages).
struct KeyRef {
  uint64_t page_offset = 0;
  uint32_t entries = 0;
  uint32_t index = 0;
};

// The arguments of both attention kernels; every pointer is in the memory the kernels run on
// (device memory for the GPU, host memory for the host driver).
//   q:         [num_queries][num_heads][512] (normalised, RoPE'd queries)
//   keys:      every query's keys, query t's at [key_begin[t], key_begin[t + 1])
//   key_query: per key, its query (so a thread finds its query without a search)
//   logits:    step 1's output, [num_keys][num_heads]
//   probs:     step 3's input, [num_keys][num_heads]
//   out:       step 3's output, [num_queries][num_heads][512]
struct AttentionArgs {
  const uint8_t* cache = nullptr;
  const float* q = nullptr;
  const KeyRef* keys = nullptr;
  const uint32_t* key_begin = nullptr;
  const uint32_t* key_query = nullptr;
  float* logits = nullptr;
  const float* probs = nullptr;
  float* out = nullptr;
  float scale = 0;
  uint32_t num_queries = 0;
  uint32_t num_heads = 0;
  uint32_t num_keys = 0;
};

// 2^(byte - 127) as dsv4::Ue8m0Decode (std::ldexp) gives it, byte 0 (a denormal) included.
KVW_HOST_DEVICE inline float ScaleOfByte(uint8_t byte) {
  return byte == 0 ? kvwire::gpu::BitsFloat(0x00400000u) : kvwire::gpu::ScaleValue(byte);
}

// Dimension d of a key, decoded as dsv4::DecodeKvRecord does: e4m3 value times its tile's
// scale for the 448 NoPE dims, the bf16 value for the 64 RoPE dims.
KVW_HOST_DEVICE inline float KeyValue(const uint8_t* cache, const KeyRef& key, uint32_t d) {
  using namespace kvwire::gpu;
  const uint8_t* page = cache + key.page_offset;
  const uint8_t* data = page + KvDataRowOffset(key.index);
  if (d < kKvNopeDims) {
    const uint8_t* scales = page + KvScaleRowOffset(key.entries, key.index);
    return MulRn(E4m3ToFloat(data[d]), ScaleOfByte(scales[d / kKvTileDims]));
  }
  const uint32_t r = d - kKvNopeDims;
  return Bf16ToFloat(
      static_cast<uint16_t>(data[kKvNopeDims + 2 * r] | (data[kKvNopeDims + 2 * r + 1] << 8)));
}

// Step 1 for (key k, head h): dsv4::Dot's order (eight partial sums over i = 8m + j, summed
// pairwise), times the scale. Each tile's scale is looked up once; the values are KeyValue's.
KVW_HOST_DEVICE inline float LogitOf(const AttentionArgs& a, uint32_t k, uint32_t h) {
  using namespace kvwire::gpu;
  const KeyRef key = a.keys[k];
  const float* q = a.q + (static_cast<uint64_t>(a.key_query[k]) * a.num_heads + h) * kHeadDim;
  const uint8_t* page = a.cache + key.page_offset;
  const uint8_t* data = page + KvDataRowOffset(key.index);
  const uint8_t* scales = page + KvScaleRowOffset(key.entries, key.index);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (uint32_t tile = 0; tile < kKvTiles; ++tile) {
    const float scale = ScaleOfByte(scales[tile]);
    for (uint32_t i = tile * kKvTileDims; i < (tile + 1) * kKvTileDims; ++i) {
      acc[i % 8] = AddRn(acc[i % 8], MulRn(q[i], MulRn(E4m3ToFloat(data[i]), scale)));
    }
  }
  for (uint32_t i = kKvNopeDims; i < kHeadDim; ++i) {
    acc[i % 8] = AddRn(acc[i % 8], MulRn(q[i], KeyValue(a.cache, key, i)));
  }
  const float s = AddRn(AddRn(AddRn(acc[0], acc[1]), AddRn(acc[2], acc[3])),
                        AddRn(AddRn(acc[4], acc[5]), AddRn(acc[6], acc[7])));
  return MulRn(s, a.scale);
}

// Step 3 for (query t, head h, dim d): the keys in order, each p * key[d] added to a sum that
// starts at 0, as AttendWithSink accumulates `out`.
KVW_HOST_DEVICE inline float OutputOf(const AttentionArgs& a, uint32_t t, uint32_t h, uint32_t d) {
  float acc = 0.0f;
  for (uint32_t k = a.key_begin[t]; k < a.key_begin[t + 1]; ++k) {
    acc = AddRn(acc, MulRn(a.probs[static_cast<uint64_t>(k) * a.num_heads + h],
                           KeyValue(a.cache, a.keys[k], d)));
  }
  return acc;
}

}  // namespace dsv4::gpu

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_GPU_ATTENTION_MATH_H_
