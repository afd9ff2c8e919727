// The paged KV cache of one model instance: every DeepSeek-V4 cache group of
// Config::CacheLayout(), backed by one kvwire::ShareableBuffer (so the shm transport maps it),
// with a block allocator. Prefill and decode instances allocate differently (the allocator
// hands out blocks in a seeded shuffled order), so block ids never line up by accident.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_KV_CACHE_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

#include "examples/dsv4/model/config.h"
#include "kvwire/connector.h"
#include "kvwire/layout.h"

namespace dsv4 {

class KvCache {
 public:
  // `num_blocks` blocks per paged group, `max_requests` slots per state group.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const Config& config, uint64_t num_blocks,
                                                         uint64_t max_requests,
                                                         uint64_t allocation_seed);
  ~KvCache();

  // The layout with its backing addresses, and the memory behind it: what
  // kvwire::Connector::RegisterKvCaches takes.
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

  // Page of (group, layer of the model, block id); nullptr when out of range.
  uint8_t* Page(const std::string& group, int layer, int64_t block) const;

  class Impl;

 private:
  explicit KvCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_KV_CACHE_H_
