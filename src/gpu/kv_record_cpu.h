// CPU reference of the fp8 KV-record encode (kv_record.h): what the GPU kernels are checked
// against, and the host path of engines without a GPU.
#ifndef KVWIRE_GPU_KV_RECORD_CPU_H_
#define KVWIRE_GPU_KV_RECORD_CPU_H_

#include <cstdint>

#include "absl/status/status.h"

#include "src/gpu/kv_record.h"

namespace kvwire::gpu {

// Encodes the 512 floats at `src` into one 576-byte data row and one 8-byte scale row.
void EncodeKvRecordCpu(const float* src, uint8_t* data_row, uint8_t* scale_row);
// Decodes a record back into 512 floats (NoPE dequantised, RoPE widened).
void DecodeKvRecordCpu(const uint8_t* data_row, const uint8_t* scale_row, float* out);

// Checks the arguments of a paged encode: InvalidArgument naming the first bad one. The GPU
// kernels take the same arguments and are launched only after this passes. Slots are not
// read here (they may live in device memory).
absl::Status ValidateKvEncodeArgs(const KvEncodeArgs& args);
// The paged encode on the CPU; `args.slots` must lie in host memory and every non-negative
// slot below `args.num_slots` (InvalidArgument otherwise, before anything is written).
absl::Status EncodeKvRecordsCpu(const KvEncodeArgs& args);

}  // namespace kvwire::gpu

#endif  // KVWIRE_GPU_KV_RECORD_CPU_H_
