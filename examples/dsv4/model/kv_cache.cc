// Paged KV cache over one ShareableBuffer, with per-group free lists.
#include "examples/dsv4/model/kv_cache.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"

#include "kvwire/memory.h"
#include "src/util/mutex.h"

namespace dsv4 {

class KvCache::Impl {
 public:
  kvwire::Layout layout;
  kvwire::ShareableBuffer buffer;
  mutable kvwire::Mutex mu;
  // Free block ids per group; handed out from the back.
  std::map<std::string, std::vector<int64_t>> free ABSL_GUARDED_BY(mu);

  // Logical blocks a group needs for `num_tokens` tokens (state groups: one slot).
  static uint64_t BlocksFor(const kvwire::CacheGroup& g, uint64_t num_tokens) {
    if (g.per_request_state) return 1;
    return (num_tokens + g.tokens_per_block - 1) / g.tokens_per_block;
  }

  // Extends `table` to cover num_tokens; all or nothing.
  absl::Status Extend(kvwire::BlockTable& table, uint64_t num_tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const kvwire::CacheGroup& g : layout.groups) {
      const uint64_t have = table[g.name].size();
      const uint64_t need = BlocksFor(g, num_tokens);
      if (need > have && need - have > free[g.name].size()) {
        return absl::ResourceExhaustedError(absl::StrCat("KV cache group '", g.name,
                                                         "': ", need - have, " blocks needed, ",
                                                         free[g.name].size(), " free"));
      }
    }
    for (const kvwire::CacheGroup& g : layout.groups) {
      std::vector<int64_t>& ids = table[g.name];
      std::vector<int64_t>& pool = free[g.name];
      while (ids.size() < BlocksFor(g, num_tokens)) {
        ids.push_back(pool.back());
        pool.pop_back();
      }
    }
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const Config& config, uint64_t num_blocks,
                                                         uint64_t max_requests,
                                                         uint64_t allocation_seed) {
  if (num_blocks == 0 || max_requests == 0) {
    return absl::InvalidArgumentError("KvCache: num_blocks and max_requests must be > 0");
  }
  auto impl = std::make_unique<Impl>();
  impl->layout = config.CacheLayout();
  const uint64_t bytes = kvwire::AssignBacking(&impl->layout, 0, num_blocks, max_requests);
  absl::StatusOr<kvwire::ShareableBuffer> buffer =
      kvwire::ShareableBuffer::Create(std::max<uint64_t>(bytes, 1), "dsv4-kv-cache");
  if (!buffer.ok()) return buffer.status();
  impl->buffer = std::move(*buffer);
  kvwire::AssignBacking(&impl->layout, reinterpret_cast<uint64_t>(impl->buffer.data()), num_blocks,
                        max_requests);
  // A seeded shuffle per group: two instances with different seeds use different block ids
  // for the same request, which is what the transfer has to cope with.
  uint64_t state = allocation_seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  kvwire::MutexLock lock(&impl->mu);
  for (const kvwire::CacheGroup& g : impl->layout.groups) {
    std::vector<int64_t>& ids = impl->free[g.name];
    ids.resize(g.num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[next() % i]);
  }
  return std::unique_ptr<KvCache>(new KvCache(std::move(impl)));
}

KvCache::KvCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvCache::~KvCache() = default;

const kvwire::Layout& KvCache::layout() const { return impl_->layout; }

std::vector<kvwire::KvMemory> KvCache::memory() const {
  return {kvwire::KvMemory{impl_->buffer.data(), impl_->buffer.size()}};
}

absl::StatusOr<kvwire::BlockTable> KvCache::Allocate(uint64_t num_tokens) {
  kvwire::BlockTable table;
  kvwire::MutexLock lock(&impl_->mu);
  if (absl::Status s = impl_->Extend(table, num_tokens); !s.ok()) return s;
  return table;
}

absl::Status KvCache::Grow(kvwire::BlockTable& table, uint64_t num_tokens) {
  kvwire::MutexLock lock(&impl_->mu);
  return impl_->Extend(table, num_tokens);
}

void KvCache::Free(const kvwire::BlockTable& table) {
  kvwire::MutexLock lock(&impl_->mu);
  for (const auto& [group, ids] : table) {
    auto it = impl_->free.find(group);
    if (it == impl_->free.end()) continue;
    for (int64_t id : ids) {
      if (id >= 0) it->second.push_back(id);
    }
  }
}

uint64_t KvCache::UsedBlocks() const {
  kvwire::MutexLock lock(&impl_->mu);
  uint64_t used = 0;
  for (const kvwire::CacheGroup& g : impl_->layout.groups) {
    used += g.num_blocks - impl_->free.at(g.name).size();
  }
  return used;
}

uint8_t* KvCache::Page(const std::string& group, int layer, int64_t block) const {
  const kvwire::CacheGroup* g = impl_->layout.FindGroup(group);
  if (g == nullptr || block < 0 || static_cast<uint64_t>(block) >= g->num_blocks) return nullptr;
  auto it = std::find(g->layers.begin(), g->layers.end(), layer);
  if (it == g->layers.end()) return nullptr;
  return reinterpret_cast<uint8_t*>(
      g->BlockAddress(static_cast<size_t>(it - g->layers.begin()), block, 0));
}

}  // namespace dsv4
