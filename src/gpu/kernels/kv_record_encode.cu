// The KV-cache write: fp32 KV vectors -> 584-byte fp8 records in their pages. Compiled by nvcc
// (CUDA) and by hipcc (-x hip); the record format and every conversion come from
// kv_record.h, the same code as the CPU reference, so both produce identical bytes.
#include "src/gpu/kernels/kernels.h"
#include "src/gpu/kv_record.h"

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define KVW_KERNELS_NS hip_kernels
using StreamT = hipStream_t;
static int LastError() { return static_cast<int>(hipGetLastError()); }
#else
#include <cuda_runtime.h>
#define KVW_KERNELS_NS cuda_kernels
using StreamT = cudaStream_t;
static int LastError() { return static_cast<int>(cudaGetLastError()); }
#endif

namespace kvwire::gpu::KVW_KERNELS_NS {
namespace {

// One block of 64 threads per token; thread j owns column j of every NoPE tile and RoPE dim j.
constexpr unsigned kThreads = kKvTileDims;
static_assert(kKvRopeDims == kThreads, "one RoPE dim per thread");

__global__ void __launch_bounds__(kThreads) EncodeKernel(KvEncodeArgs args) {
  __shared__ uint32_t amax[kKvTiles][kThreads];
  const unsigned token = blockIdx.x;
  const unsigned j = threadIdx.x;
  const int64_t slot = args.slots[token];
  // The whole block leaves together: no barrier is skipped.
  if (slot < 0 || static_cast<uint64_t>(slot) >= args.num_slots) return;
  const float* src = args.src + token * args.src_stride;
  float x[kKvTiles];
  for (unsigned t = 0; t < kKvTiles; ++t) {
    x[t] = src[t * kKvTileDims + j];
    amax[t][j] = AbsBits(x[t]);
  }
  __syncthreads();
  // Tree max over the 64 columns of each tile: integer max, so the order does not matter.
  for (unsigned width = kThreads / 2; width > 0; width /= 2) {
    if (j < width) {
      for (unsigned t = 0; t < kKvTiles; ++t) {
        amax[t][j] = amax[t][j] > amax[t][j + width] ? amax[t][j] : amax[t][j + width];
      }
    }
    __syncthreads();
  }
  uint8_t* page = args.cache + static_cast<uint64_t>(slot) / args.block_size * args.page_bytes;
  const uint64_t entry = static_cast<uint64_t>(slot) % args.block_size;
  uint8_t* data = page + KvDataRowOffset(entry);
  uint8_t* scales = page + KvScaleRowOffset(args.block_size, entry);
  for (unsigned t = 0; t < kKvTiles; ++t) {
    const uint8_t scale = ScaleByteForAmax(amax[t][0]);
    data[t * kKvTileDims + j] = EncodeNope(x[t], scale);
    if (j == t) scales[t] = scale;
  }
  if (j == kKvTiles) scales[kKvTiles] = 0;
  const uint16_t rope = FloatToBf16(src[kKvNopeDims + j]);
  data[kKvNopeDims + 2 * j] = static_cast<uint8_t>(rope & 0xff);
  data[kKvNopeDims + 2 * j + 1] = static_cast<uint8_t>(rope >> 8);
}

}  // namespace

int EncodeKvRecords(const KvEncodeArgs& args, void* stream) {
  if (args.num_tokens == 0) return 0;
  EncodeKernel<<<args.num_tokens, kThreads, 0, static_cast<StreamT>(stream)>>>(args);
  return LastError();
}

}  // namespace kvwire::gpu::KVW_KERNELS_NS
