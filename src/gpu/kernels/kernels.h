// Host-side launchers of the GPU kernels. One source (kernels/*.cu) is compiled by nvcc into
// namespace cuda_kernels and by hipcc into hip_kernels, so both backends can live in one
// program. Plain C++17 without abseil: nvcc and hipcc compile the launchers. Each returns the
// runtime's error code (0 = success), which the backend turns into an absl::Status.
#ifndef KVWIRE_GPU_KERNELS_KERNELS_H_
#define KVWIRE_GPU_KERNELS_KERNELS_H_

#include "src/gpu/kv_record.h"

namespace kvwire::gpu {
namespace cuda_kernels {
// Enqueues the paged fp8 KV-record encode on `stream` (a cudaStream_t). `args` must have
// passed ValidateKvEncodeArgs; every pointer in it is a device (or managed) pointer.
int EncodeKvRecords(const KvEncodeArgs& args, void* stream);
}  // namespace cuda_kernels
namespace hip_kernels {
// Same, for HIP (`stream` is a hipStream_t).
int EncodeKvRecords(const KvEncodeArgs& args, void* stream);
}  // namespace hip_kernels
}  // namespace kvwire::gpu

#endif  // KVWIRE_GPU_KERNELS_KERNELS_H_
