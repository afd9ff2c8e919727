// The attention kernels' host driver: the same per-thread functions (attention_math.h) run in
// a loop on the CPU, over host memory. It is what a machine without a GPU runs for the
// KvDevice::kHostKernels cache, and what the tests check the CPU path against. Also the
// softmax between the two kernels (step 2), which runs on the host in both cases.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_GPU_HOST_DRIVER_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_GPU_HOST_DRIVER_H_

#include <cstdint>

#include "examples/dsv4/model/gpu/attention_math.h"

namespace dsv4::gpu {

// Steps 1 and 3 of attention_math.h, every pointer of `args` in host memory.
void AttentionLogitsHost(const AttentionArgs& args);
void AttentionOutputHost(const AttentionArgs& args);

// Step 2, as dsv4::AttendWithSink computes it: for each (query t, head h) the keys'
// probabilities p = exp(logit - m) / (exp(sink_h - m) + sum exp(logit - m)), m the largest of
// the sink and the logits. logits and probs are [num_keys][num_heads]; sinks [num_heads].
void SoftmaxWithSink(const float* logits, const uint32_t* key_begin, uint32_t num_queries,
                     uint32_t num_heads, const float* sinks, float* probs);

}  // namespace dsv4::gpu

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_GPU_HOST_DRIVER_H_
