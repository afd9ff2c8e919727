// Host driver of the attention kernels, and the softmax between them.
#include "examples/dsv4/model/gpu/host_driver.h"

#include <algorithm>
#include <cmath>

namespace dsv4::gpu {

void AttentionLogitsHost(const AttentionArgs& args) {
  for (uint32_t k = 0; k < args.num_keys; ++k) {
    for (uint32_t h = 0; h < args.num_heads; ++h) {
      args.logits[static_cast<uint64_t>(k) * args.num_heads + h] = LogitOf(args, k, h);
    }
  }
}

void AttentionOutputHost(const AttentionArgs& args) {
  for (uint32_t t = 0; t < args.num_queries; ++t) {
    for (uint32_t h = 0; h < args.num_heads; ++h) {
      float* out = args.out + (static_cast<uint64_t>(t) * args.num_heads + h) * kHeadDim;
      for (uint32_t d = 0; d < kHeadDim; ++d) out[d] = OutputOf(args, t, h, d);
    }
  }
}

void SoftmaxWithSink(const float* logits, const uint32_t* key_begin, uint32_t num_queries,
                     uint32_t num_heads, const float* sinks, float* probs) {
  for (uint32_t t = 0; t < num_queries; ++t) {
    const uint64_t begin = key_begin[t], end = key_begin[t + 1];
    for (uint32_t h = 0; h < num_heads; ++h) {
      auto at = [&](uint64_t k) { return k * num_heads + h; };
      float m = sinks[h];
      for (uint64_t k = begin; k < end; ++k) m = std::max(m, logits[at(k)]);
      float denom = std::exp(sinks[h] - m);
      for (uint64_t k = begin; k < end; ++k) {
        probs[at(k)] = std::exp(logits[at(k)] - m);
        denom += probs[at(k)];
      }
      for (uint64_t k = begin; k < end; ++k) probs[at(k)] = probs[at(k)] / denom;
    }
  }
}

}  // namespace dsv4::gpu
