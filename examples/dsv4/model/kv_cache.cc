// Paged KV cache over one ShareableBuffer (or one GPU allocation), with per-group free lists.
#include "examples/dsv4/model/kv_cache.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"

#include "examples/dsv4/model/gpu/kv_executor.h"
#include "kvwire/memory.h"
#include "src/gpu/runtime.h"
#include "src/util/mutex.h"

namespace dsv4 {

class KvCache::Impl {
 public:
  KvCacheOptions options;
  kvwire::Layout layout;
  kvwire::ShareableBuffer buffer;           // kCpu, kHostKernels
  kvwire::gpu::DeviceBuffer device_buffer;  // kGpu
  std::unique_ptr<gpu::KvExecutor> executor;
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

const char* KvDeviceName(KvDevice device) {
  switch (device) {
    case KvDevice::kCpu:
      return "cpu";
    case KvDevice::kGpu:
      return "gpu";
    case KvDevice::kHostKernels:
      return "host-kernels";
  }
  return "?";
}

absl::StatusOr<KvDevice> ParseKvDevice(std::string_view name) {
  if (name == "cpu") return KvDevice::kCpu;
  if (name == "gpu") return KvDevice::kGpu;
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-device ", std::string(name), ": expected cpu or gpu"));
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const Config& config, uint64_t num_blocks,
                                                         uint64_t max_requests,
                                                         uint64_t allocation_seed,
                                                         const KvCacheOptions& options) {
  if (num_blocks == 0 || max_requests == 0) {
    return absl::InvalidArgumentError("KvCache: num_blocks and max_requests must be > 0");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->layout = config.CacheLayout();
  const uint64_t bytes =
      std::max<uint64_t>(kvwire::AssignBacking(&impl->layout, 0, num_blocks, max_requests), 1);
  void* base = nullptr;
  if (options.device == KvDevice::kGpu) {
    kvwire::gpu::Runtime& rt = kvwire::gpu::DefaultRuntime();
    absl::StatusOr<std::unique_ptr<gpu::KvExecutor>> executor =
        gpu::MakeDeviceExecutor(rt, options.gpu_device);
    if (!executor.ok()) return executor.status();
    impl->executor = std::move(*executor);
    absl::StatusOr<kvwire::gpu::DeviceBuffer> memory =
        kvwire::gpu::DeviceBuffer::Allocate(rt, options.gpu_device, bytes);
    if (!memory.ok()) return memory.status();
    impl->device_buffer = std::move(*memory);
    base = impl->device_buffer.data();
    // Zeroed, as the host cache's fresh mapping is: no page starts with stale device bytes.
    const std::vector<uint8_t> zeros(std::min<uint64_t>(bytes, 4 << 20), 0);
    for (uint64_t at = 0; at < bytes; at += zeros.size()) {
      if (absl::Status s = impl->executor->Upload(static_cast<uint8_t*>(base) + at, zeros.data(),
                                                  std::min<uint64_t>(zeros.size(), bytes - at));
          !s.ok()) {
        return s;
      }
    }
  } else {
    absl::StatusOr<kvwire::ShareableBuffer> buffer =
        kvwire::ShareableBuffer::Create(bytes, "dsv4-kv-cache");
    if (!buffer.ok()) return buffer.status();
    impl->buffer = std::move(*buffer);
    base = impl->buffer.data();
    if (options.device == KvDevice::kHostKernels) impl->executor = gpu::MakeHostExecutor();
  }
  kvwire::AssignBacking(&impl->layout, reinterpret_cast<uint64_t>(base), num_blocks, max_requests);
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

KvDevice KvCache::kv_device() const { return impl_->options.device; }

int KvCache::gpu_device() const {
  return impl_->options.device == KvDevice::kGpu ? impl_->options.gpu_device : -1;
}

gpu::KvExecutor* KvCache::executor() const { return impl_->executor.get(); }

std::vector<kvwire::KvMemory> KvCache::memory() const {
  if (impl_->options.device == KvDevice::kGpu) {
    // Registered as device memory: the engine reaches it through the GPU runtime only (and
    // the connector clears rows in it with the runtime's copies, never with the CPU).
    return {kvwire::KvMemory{impl_->device_buffer.data(), impl_->device_buffer.size(),
                             kvwire::MemoryKind::kGpu, impl_->options.gpu_device}};
  }
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

std::map<std::string, uint64_t> KvCache::FreeBlocks() const {
  kvwire::MutexLock lock(&impl_->mu);
  std::map<std::string, uint64_t> free;
  for (const auto& [group, ids] : impl_->free) free[group] = ids.size();
  return free;
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
