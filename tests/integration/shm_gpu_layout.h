// The regions of shm_gpu_peer, shared with shm_gpu_test: two regions inside one device
// allocation (at different offsets, so that a wrong offset in the key shows) and two host ones
// (memfd-backed, and plain heap memory).
#ifndef KVWIRE_TESTS_INTEGRATION_SHM_GPU_LAYOUT_H_
#define KVWIRE_TESTS_INTEGRATION_SHM_GPU_LAYOUT_H_

#include <cstdint>

namespace kvwire::testing {

inline constexpr int kPeerRegions = 4;  // GPU, GPU (same allocation), memfd host, heap host
inline constexpr uint64_t kPeerRegionBytes = 2 << 20;
inline constexpr uint64_t kPeerRegionOffset[2] = {4096, (2 << 20) + 65536};
inline constexpr uint64_t kPeerAllocationBytes = (4 << 20) + 131072;

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_INTEGRATION_SHM_GPU_LAYOUT_H_
