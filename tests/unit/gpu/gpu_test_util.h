// Shared by the GPU runtime test and its IPC peer process: the runtimes linked into this
// program, and a byte pattern both sides can check.
#ifndef KVWIRE_TESTS_UNIT_GPU_GPU_TEST_UTIL_H_
#define KVWIRE_TESTS_UNIT_GPU_GPU_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "src/gpu/gpu_config.h"
#include "src/gpu/runtime.h"

namespace kvwire::gpu::testing {

// The GPU runtimes compiled into this program (libkvwire's and every other one built).
inline std::vector<Runtime*> GpuRuntimes() {
  std::vector<Runtime*> v;
#if KVWIRE_GPU_BUILT_CUDA
  v.push_back(&CudaRuntime());
#endif
#if KVWIRE_GPU_BUILT_HIP
  v.push_back(&HipRuntime());
#endif
  return v;
}

inline Runtime* RuntimeByName(const std::string& name) {
  for (Runtime* rt : GpuRuntimes()) {
    if (name == BackendName(rt->backend())) return rt;
  }
  return nullptr;
}

// Not periodic in 256, so a shifted or truncated copy does not pass by accident.
inline uint8_t PatternByte(uint64_t i, uint32_t seed) {
  return static_cast<uint8_t>((i ^ (i >> 8) ^ (i >> 16)) * 31 + seed);
}
inline std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = PatternByte(i, seed);
  return v;
}

}  // namespace kvwire::gpu::testing

#endif  // KVWIRE_TESTS_UNIT_GPU_GPU_TEST_UTIL_H_
