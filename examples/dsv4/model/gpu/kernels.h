// Host-side launchers of the reference engine's attention kernels (attention_decode.cu). One
// source is compiled by nvcc into namespace cuda_kernels and by hipcc into hip_kernels, as
// src/gpu/kernels does. Plain C++17 without abseil: nvcc and hipcc compile the launchers.
// Each sets `device` current, enqueues on `stream` (a cudaStream_t / hipStream_t) and
// returns the runtime's error code (0 = success); ErrorName turns a code into text.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KERNELS_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KERNELS_H_

#include "examples/dsv4/model/gpu/attention_math.h"

namespace dsv4::gpu {
namespace cuda_kernels {
// Step 1 (attention_math.h): args.logits for every (key, head).
int AttentionLogits(int device, const AttentionArgs& args, void* stream);
// Step 3: args.out for every (query, head, dim) from args.probs.
int AttentionOutput(int device, const AttentionArgs& args, void* stream);
const char* ErrorName(int code);
}  // namespace cuda_kernels
namespace hip_kernels {
int AttentionLogits(int device, const AttentionArgs& args, void* stream);
int AttentionOutput(int device, const AttentionArgs& args, void* stream);
const char* ErrorName(int code);
}  // namespace hip_kernels
}  // namespace dsv4::gpu

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_GPU_KERNELS_H_
