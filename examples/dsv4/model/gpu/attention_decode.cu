// The reference engine's attention decode on a GPU: step 1 (logits) and step 3 (weighted sum
// of the key records) of attention_math.h, reading the fp8 records straight from the paged
// cache in device memory. Compiled by nvcc (CUDA) and by hipcc (-x hip); every value comes
// from the same inline functions as the host driver, in the CPU path's order.
#include "examples/dsv4/model/gpu/attention_math.h"
#include "examples/dsv4/model/gpu/kernels.h"

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define DSV4_KERNELS_NS hip_kernels
using StreamT = hipStream_t;
static int SetDevice(int device) { return static_cast<int>(hipSetDevice(device)); }
static int LastError() { return static_cast<int>(hipGetLastError()); }
static const char* Name(int code) { return hipGetErrorName(static_cast<hipError_t>(code)); }
#else
#include <cuda_runtime.h>
#define DSV4_KERNELS_NS cuda_kernels
using StreamT = cudaStream_t;
static int SetDevice(int device) { return static_cast<int>(cudaSetDevice(device)); }
static int LastError() { return static_cast<int>(cudaGetLastError()); }
static const char* Name(int code) { return cudaGetErrorName(static_cast<cudaError_t>(code)); }
#endif

namespace dsv4::gpu::DSV4_KERNELS_NS {
namespace {

constexpr unsigned kThreads = 128;

// One thread per (key, head): a 512-term dot product in dsv4::Dot's order.
__global__ void __launch_bounds__(kThreads) LogitsKernel(AttentionArgs args) {
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= static_cast<uint64_t>(args.num_keys) * args.num_heads) return;
  const uint32_t k = static_cast<uint32_t>(i / args.num_heads);
  const uint32_t h = static_cast<uint32_t>(i % args.num_heads);
  args.logits[i] = LogitOf(args, k, h);
}

// One thread per (query, head, dim); neighbouring threads read neighbouring bytes of a record.
__global__ void __launch_bounds__(kThreads) OutputKernel(AttentionArgs args) {
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= static_cast<uint64_t>(args.num_queries) * args.num_heads * kHeadDim) return;
  const uint32_t d = static_cast<uint32_t>(i % kHeadDim);
  const uint64_t th = i / kHeadDim;
  const uint32_t h = static_cast<uint32_t>(th % args.num_heads);
  const uint32_t t = static_cast<uint32_t>(th / args.num_heads);
  args.out[i] = OutputOf(args, t, h, d);
}

unsigned Blocks(uint64_t threads) {
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

}  // namespace

int AttentionLogits(int device, const AttentionArgs& args, void* stream) {
  if (int e = SetDevice(device); e != 0) return e;
  const uint64_t n = static_cast<uint64_t>(args.num_keys) * args.num_heads;
  if (n == 0) return 0;
  LogitsKernel<<<Blocks(n), kThreads, 0, static_cast<StreamT>(stream)>>>(args);
  return LastError();
}

int AttentionOutput(int device, const AttentionArgs& args, void* stream) {
  if (int e = SetDevice(device); e != 0) return e;
  const uint64_t n = static_cast<uint64_t>(args.num_queries) * args.num_heads * kHeadDim;
  if (n == 0) return 0;
  OutputKernel<<<Blocks(n), kThreads, 0, static_cast<StreamT>(stream)>>>(args);
  return LastError();
}

const char* ErrorName(int code) { return Name(code); }

}  // namespace dsv4::gpu::DSV4_KERNELS_NS
