// The paged KV cache of one model instance: every DeepSeek-V4 cache group of
// Config::CacheLayout(), backed by one kvwire::ShareableBuffer (so the shm transport maps it),
// with a block allocator. Prefill and decode instances allocate differently (the allocator
// hands out blocks in a seeded shuffled order), so block ids never line up by accident.
//
// The pages live in host memory (KvDevice::kCpu, the reference), or in one GPU allocation
// (kGpu: the model writes records and runs attention there with the kernels of gpu/, and
// memory() is device memory, for the connector to register as such), or in host memory that
// only the GPU path's code touches (kHostKernels: the kernels' host drivers; for tests and
// machines without a device).
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_KV_CACHE_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_KV_CACHE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

#include "examples/dsv4/model/config.h"
#include "kvwire/connector.h"
#include "kvwire/layout.h"

namespace dsv4 {

namespace gpu {
class KvExecutor;
}

enum class KvDevice { kCpu, kGpu, kHostKernels };
// "cpu", "gpu", "host-kernels".
const char* KvDeviceName(KvDevice device);
// "cpu" or "gpu" (the values of kvwire-dsv4's --kv-device); InvalidArgument otherwise.
absl::StatusOr<KvDevice> ParseKvDevice(std::string_view name);

struct KvCacheOptions {
  KvDevice device = KvDevice::kCpu;
  int gpu_device = 0;  // ordinal of the GPU (kGpu), in gpu::DefaultRuntime()
};

class KvCache {
 public:
  // `num_blocks` blocks per paged group, `max_requests` slots per state group. kGpu on a
  // machine (or build) without a device: Unavailable with the runtime's one-line reason.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const Config& config, uint64_t num_blocks,
                                                         uint64_t max_requests,
                                                         uint64_t allocation_seed,
                                                         const KvCacheOptions& options = {});
  ~KvCache();

  KvDevice kv_device() const;
  // The GPU ordinal of a kGpu cache; -1 otherwise.
  int gpu_device() const;
  // Where the model runs its KV-cache work: nullptr for kCpu (plain host code on the pages).
  gpu::KvExecutor* executor() const;

  // The layout with its backing addresses, and the memory behind it: what
  // kvwire::Connector::RegisterKvCaches takes (device memory of gpu_device() for kGpu).
  const kvwire::Layout& layout() const;
  std::vector<kvwire::KvMemory> memory() const;

  // Blocks of every group for a request of `num_tokens` tokens (state groups: one slot).
  // ResourceExhausted when a pool is empty (nothing is taken then).
  absl::StatusOr<kvwire::BlockTable> Allocate(uint64_t num_tokens);
  // Grows `table` so that it covers `num_tokens` tokens.
  absl::Status Grow(kvwire::BlockTable& table, uint64_t num_tokens);
  void Free(const kvwire::BlockTable& table);
  // Blocks in use over all groups (0 when every request has been freed).
  uint64_t UsedBlocks() const;
  // Free blocks (state groups: slots) of each group, by group name.
  std::map<std::string, uint64_t> FreeBlocks() const;

  // Page of (group, layer of the model, block id); nullptr when out of range. A device
  // address for kGpu (not to be dereferenced on the host).
  uint8_t* Page(const std::string& group, int layer, int64_t block) const;

  class Impl;

 private:
  explicit KvCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_KV_CACHE_H_
