// KvCache: backing, accounting, all-or-nothing allocation, shuffled ids.
#include "examples/dsv4/model/kv_cache.h"

#include <set>

#include <gtest/gtest.h>

namespace dsv4 {
namespace {

Config Tiny() {
  absl::StatusOr<Config> c = Config::FromFile(std::string(DSV4_CONFIG_DIR) + "/tiny.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(KvCacheTest, BackingCoversTheLayout) {
  absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(Tiny(), 8, 3, 1);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const kvwire::Layout& layout = (*cache)->layout();
  std::vector<kvwire::KvMemory> mem = (*cache)->memory();
  ASSERT_EQ(mem.size(), 1u);
  const uint64_t lo = reinterpret_cast<uint64_t>(mem[0].ptr), hi = lo + mem[0].length;
  for (const kvwire::CacheGroup& g : layout.groups) {
    EXPECT_EQ(g.num_blocks, g.per_request_state ? 3u : 8u) << g.name;
    for (size_t li = 0; li < g.layers.size(); ++li) {
      const uint64_t first = g.BlockAddress(li, 0, 0);
      const uint64_t last = g.BlockAddress(li, g.num_blocks - 1, 0) + g.page_bytes;
      EXPECT_GE(first, lo);
      EXPECT_LE(last, hi) << g.name;
      EXPECT_EQ((*cache)->Page(g.name, g.layers[li], 0), reinterpret_cast<uint8_t*>(first));
    }
  }
  EXPECT_EQ((*cache)->Page("swa_kv", 0, 8), nullptr);
  EXPECT_EQ((*cache)->Page("swa_kv", 0, -1), nullptr);
  EXPECT_EQ((*cache)->Page("c4a_kv", 0, 0), nullptr);  // layer 0 is window-only
  EXPECT_EQ((*cache)->Page("nope", 0, 0), nullptr);
}

TEST(KvCacheTest, AllocateGrowFreeAccounting) {
  absl::StatusOr<std::unique_ptr<KvCache>> made = KvCache::Create(Tiny(), 8, 2, 1);
  ASSERT_TRUE(made.ok());
  KvCache& cache = **made;
  EXPECT_EQ(cache.UsedBlocks(), 0u);
  absl::StatusOr<kvwire::BlockTable> a = cache.Allocate(130);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->at("swa_kv").size(), 3u);  // 64-token blocks
  EXPECT_EQ(a->at("c4a_kv").size(), 1u);  // 256-token blocks
  EXPECT_EQ(a->at("c128a_kv").size(), 1u);
  EXPECT_EQ(a->at("c4a_indexer_k").size(), 1u);
  EXPECT_EQ(a->at("c4a_compressor_state").size(), 1u);
  EXPECT_EQ(a->at("c128a_compressor_state").size(), 1u);
  EXPECT_EQ(a->at("c4a_indexer_compressor_state").size(), 1u);
  const uint64_t after_a = cache.UsedBlocks();
  EXPECT_EQ(after_a, 3u + 1 + 1 + 1 + 3);
  ASSERT_TRUE(cache.Grow(*a, 257).ok());
  EXPECT_EQ(a->at("swa_kv").size(), 5u);
  EXPECT_EQ(a->at("c4a_kv").size(), 2u);
  EXPECT_EQ(a->at("c4a_compressor_state").size(), 1u);
  std::set<int64_t> ids(a->at("swa_kv").begin(), a->at("swa_kv").end());
  EXPECT_EQ(ids.size(), 5u);
  // A second request; then one that does not fit takes nothing.
  absl::StatusOr<kvwire::BlockTable> b = cache.Allocate(64);
  ASSERT_TRUE(b.ok());
  const uint64_t used = cache.UsedBlocks();
  absl::StatusOr<kvwire::BlockTable> c = cache.Allocate(64 * 3);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);  // 8 - 5 - 1 = 2 left
  EXPECT_EQ(cache.UsedBlocks(), used);
  EXPECT_EQ(cache.Allocate(64).status().code(), absl::StatusCode::kResourceExhausted)
      << "state slots: max_requests = 2";
  EXPECT_EQ(cache.Grow(*b, 64 * 4).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(b->at("swa_kv").size(), 1u);
  cache.Free(*a);
  cache.Free(*b);
  EXPECT_EQ(cache.UsedBlocks(), 0u);
}

TEST(KvCacheTest, SeedsShuffleBlockIds) {
  absl::StatusOr<std::unique_ptr<KvCache>> x = KvCache::Create(Tiny(), 64, 4, 1);
  absl::StatusOr<std::unique_ptr<KvCache>> y = KvCache::Create(Tiny(), 64, 4, 2);
  absl::StatusOr<std::unique_ptr<KvCache>> z = KvCache::Create(Tiny(), 64, 4, 1);
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  auto tx = (*x)->Allocate(64 * 10), ty = (*y)->Allocate(64 * 10), tz = (*z)->Allocate(64 * 10);
  ASSERT_TRUE(tx.ok() && ty.ok() && tz.ok());
  EXPECT_NE(tx->at("swa_kv"), ty->at("swa_kv"));
  EXPECT_EQ(tx->at("swa_kv"), tz->at("swa_kv"));  // same seed, same order
  std::vector<int64_t> sorted = tx->at("swa_kv");
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(sorted, tx->at("swa_kv")) << "ids come shuffled, not in order";
}

}  // namespace
}  // namespace dsv4
