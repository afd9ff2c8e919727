#include "kvwire/layout.h"

#include <random>

#include <gtest/gtest.h>

#include "kvwire/deepseek.h"

namespace kvwire {
namespace {

const CacheGroup& G(const Layout& l, const std::string& name) {
  const CacheGroup* g = l.FindGroup(name);
  EXPECT_NE(g, nullptr) << name;
  return *g;
}

TEST(LayoutTest, Dsv4PageSizesMatchDesign) {
  EXPECT_EQ(Dsv4PageBytes(64), 37440u);  // 64 x 584 = 37,376 -> 65 x 576
  EXPECT_EQ(Dsv4PageBytes(2), 1728u);    // 2 x 584 = 1,168 -> 3 x 576
  EXPECT_EQ(Dsv4PageBytes(64, 132), 8640u);
  Layout pro = DeepSeekV4ProLayout();
  ASSERT_TRUE(pro.Validate().ok());
  EXPECT_EQ(pro.groups.size(), 7u);
  EXPECT_EQ(G(pro, "swa_kv").page_bytes, 37440u);
  EXPECT_EQ(G(pro, "swa_kv").tokens_per_block, 64);
  EXPECT_EQ(G(pro, "swa_kv").window_tokens, 128);
  EXPECT_EQ(G(pro, "swa_kv").layers.size(), 62u);  // 61 + MTP
  EXPECT_EQ(G(pro, "c4a_kv").page_bytes, 37440u);
  EXPECT_EQ(G(pro, "c4a_kv").entries_per_block(), 64u);
  EXPECT_EQ(G(pro, "c4a_kv").layers.size(), 30u);
  EXPECT_EQ(G(pro, "c128a_kv").page_bytes, 1728u);
  EXPECT_EQ(G(pro, "c128a_kv").entries_per_block(), 2u);
  EXPECT_EQ(G(pro, "c128a_kv").layers.size(), 31u);
  EXPECT_EQ(G(pro, "c4a_indexer_k").page_bytes, 8640u);
  EXPECT_EQ(G(pro, "c4a_compressor_state").page_bytes, 8u * 2048 * 4);
  EXPECT_EQ(G(pro, "c128a_compressor_state").page_bytes, 128u * 1024 * 4);
  EXPECT_EQ(G(pro, "c4a_indexer_compressor_state").page_bytes, 8u * 512 * 4);
  Layout flash = DeepSeekV4FlashLayout();
  ASSERT_TRUE(flash.Validate().ok());
  EXPECT_EQ(G(flash, "swa_kv").layers.size(), 43u);
  EXPECT_EQ(G(flash, "c4a_kv").layers.size() + G(flash, "c128a_kv").layers.size(), 41u);
  EXPECT_EQ(G(flash, "c4a_kv").layers.front(), 2);
}

TEST(LayoutTest, DeepSeekV3AndMhaSizes) {
  Layout v3 = DeepSeekV3Layout(false);
  EXPECT_EQ(v3.groups.size(), 1u);
  EXPECT_EQ(G(v3, "mla_kv").page_bytes, 656u * 64);
  Layout v32 = DeepSeekV3Layout(true);
  EXPECT_EQ(G(v32, "indexer_k").page_bytes, 132u * 64);
  MhaOptions o;
  o.kv_heads = 8;
  o.head_dim = 128;
  o.tokens_per_block = 16;
  o.tp_size = 2;
  Layout mha = MhaLayout(o);
  ASSERT_TRUE(mha.Validate().ok()) << mha.Validate();
  EXPECT_EQ(G(mha, "kv").page_bytes, 16u * 4 * 128 * 2);
  EXPECT_EQ(G(mha, "kv").components, 2);
}

TEST(LayoutTest, JsonRoundTrip) {
  for (const char* name :
       {"deepseek-v4-pro", "deepseek-v4-flash", "deepseek-v3", "deepseek-v3.2", "mha"}) {
    Layout l = *PresetLayout(name);
    AssignBacking(&l, 4096, 10);
    absl::StatusOr<Layout> back = LayoutFromJson(LayoutToJson(l));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(LayoutToJson(*back), LayoutToJson(l));
    EXPECT_TRUE(CheckCompatible(l, *back).ok());
  }
  EXPECT_FALSE(LayoutFromJson("{").ok());
  EXPECT_FALSE(LayoutFromJson("{\"groups\": [{\"name\": \"x\"}]}").ok());
  absl::Status bad = LayoutFromJson(
                         R"({"groups":[{"name":"g","layers":[0],"tokens_per_block":64,
                         "page_bytes":10,"tokens_per_entry":3}]})")
                         .status();
  EXPECT_NE(bad.message().find("'g'"), std::string::npos) << bad;
  EXPECT_FALSE(PresetLayout("nope").ok());
}

std::vector<uint64_t> Sel(const CacheGroup& g, uint64_t n, uint64_t cached = 0) {
  return SelectBlocks(g, n, cached).logical_blocks;
}

TEST(LayoutTest, SelectFullHistoryAndCompression) {
  Layout pro = DeepSeekV4ProLayout();
  const CacheGroup& c4 = G(pro, "c4a_kv");
  const CacheGroup& c128 = G(pro, "c128a_kv");
  EXPECT_TRUE(Sel(c4, 3).empty());  // no complete entry yet
  EXPECT_EQ(Sel(c4, 4), (std::vector<uint64_t>{0}));
  EXPECT_EQ(Sel(c4, 256), (std::vector<uint64_t>{0}));
  EXPECT_EQ(Sel(c4, 259), (std::vector<uint64_t>{0}));  // entry 64 needs tokens 256..259
  EXPECT_EQ(Sel(c4, 260), (std::vector<uint64_t>{0, 1}));
  EXPECT_TRUE(Sel(c128, 127).empty());
  EXPECT_EQ(Sel(c128, 383), (std::vector<uint64_t>{0}));
  EXPECT_EQ(Sel(c128, 384), (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(Sel(c128, 8192).size(), 32u);
  // Prefix hit: only blocks with missing tokens move.
  EXPECT_EQ(Sel(c4, 1024, 512), (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(Sel(c4, 1024, 600), (std::vector<uint64_t>{2, 3}));
  EXPECT_TRUE(Sel(c4, 1024, 1024).empty());
}

TEST(LayoutTest, SelectWindow) {
  const Layout pro = DeepSeekV4ProLayout();
  const CacheGroup& swa = G(pro, "swa_kv");
  EXPECT_EQ(Sel(swa, 1), (std::vector<uint64_t>{0}));
  EXPECT_EQ(Sel(swa, 128), (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(Sel(swa, 129), (std::vector<uint64_t>{0, 1, 2}));  // tokens 1..128
  EXPECT_EQ(Sel(swa, 192), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(Sel(swa, 193), (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(Sel(swa, 8192), (std::vector<uint64_t>{126, 127}));
  EXPECT_EQ(Sel(swa, 8192, 8150), (std::vector<uint64_t>{127}));
}

TEST(LayoutTest, SelectStateSlots) {
  Layout pro = DeepSeekV4ProLayout();
  const CacheGroup& s4 = G(pro, "c4a_compressor_state");
  const CacheGroup& s128 = G(pro, "c128a_compressor_state");
  BlockSelection a = SelectBlocks(s4, 10);  // entries done to 8; next entry needs 4..11
  EXPECT_EQ(a.slot_begin, 4u);
  EXPECT_EQ(a.slot_count, 6u);
  BlockSelection b = SelectBlocks(s4, 3);
  EXPECT_EQ(b.slot_begin, 0u);
  EXPECT_EQ(b.slot_count, 3u);
  BlockSelection c = SelectBlocks(s128, 300);
  EXPECT_EQ(c.slot_begin, 0u);  // 256 % 128
  EXPECT_EQ(c.slot_count, 44u);
  EXPECT_TRUE(SelectBlocks(s128, 256).logical_blocks.empty());
  BlockSelection d = SelectBlocks(s4, 14);  // 8..13 -> slots 0..5
  EXPECT_EQ(d.slot_begin, 0u);
  EXPECT_EQ(d.slot_count, 6u);
}

BlockTable Table(const Layout& l, uint64_t tokens, std::mt19937_64* rng, uint64_t num_blocks) {
  BlockTable t;
  for (const CacheGroup& g : l.groups) {
    std::vector<int64_t> ids(num_blocks);
    for (uint64_t i = 0; i < num_blocks; ++i) ids[i] = static_cast<int64_t>(i);
    std::shuffle(ids.begin(), ids.end(), *rng);
    const uint64_t n =
        g.per_request_state ? 1 : (tokens + g.tokens_per_block - 1) / g.tokens_per_block;
    ids.resize(n);
    t[g.name] = ids;
  }
  return t;
}

TEST(LayoutTest, PlanMergesContiguousBlocks) {
  Layout src = DeepSeekV3Layout(false), dst = DeepSeekV3Layout(false);
  AssignBacking(&src, 1 << 20, 64);
  AssignBacking(&dst, 1 << 30, 32);
  BlockTable st{{"mla_kv", {4, 5, 6, 9}}}, dt{{"mla_kv", {0, 1, 2, 3}}};
  absl::StatusOr<TransferPlan> plan = PlanTransfer(src, st, dst, dt, 256);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->ops_before_merge, 4u * 61);
  EXPECT_EQ(plan->ops_after_merge, 2u * 61);
  EXPECT_EQ(plan->bytes, 4u * 61 * 656 * 64);
  const GroupPlan& gp = plan->groups[0];
  EXPECT_EQ(gp.ranges[0].src, src.groups[0].BlockAddress(0, 4, 0));
  EXPECT_EQ(gp.ranges[0].dst, dst.groups[0].BlockAddress(0, 0, 0));
  EXPECT_EQ(gp.ranges[0].length, 3u * 656 * 64);
  EXPECT_EQ(plan->LayerRanges(5).size(), 2u);
  EXPECT_EQ(plan->Layers().size(), 61u);
}

TEST(LayoutTest, PlanErrorsNameGroupAndBlock) {
  Layout src = DeepSeekV4FlashLayout(), dst = DeepSeekV4FlashLayout();
  AssignBacking(&src, 0, 8);
  AssignBacking(&dst, 0, 8);
  std::mt19937_64 rng(1);
  BlockTable st = Table(src, 600, &rng, 8), dt = Table(dst, 600, &rng, 8);
  ASSERT_TRUE(PlanTransfer(src, st, dst, dt, 600).ok());
  dt["c4a_kv"].resize(1);
  absl::Status s = PlanTransfer(src, st, dst, dt, 600).status();
  EXPECT_NE(s.message().find("c4a_kv"), std::string::npos) << s;
  EXPECT_NE(s.message().find("logical block 1"), std::string::npos) << s;
  dt = Table(dst, 600, &rng, 8);
  dt["swa_kv"][9] = 99;  // out of range
  dt["swa_kv"].resize(10, 99);
  s = PlanTransfer(src, st, dst, dt, 600).status();
  EXPECT_NE(s.message().find("swa_kv"), std::string::npos) << s;
  // Out-of-window blocks may be null.
  dt = Table(dst, 600, &rng, 8);
  st["swa_kv"][0] = -1;
  dt["swa_kv"][0] = -1;
  EXPECT_TRUE(PlanTransfer(src, st, dst, dt, 600).ok());
}

TEST(LayoutTest, CompatibilityErrorsNameGroupAndMismatch) {
  Layout a = DeepSeekV4ProLayout(), b = DeepSeekV4ProLayout();
  b.groups[1].page_bytes = 37376;
  absl::Status s = CheckCompatible(a, b);
  EXPECT_NE(s.message().find("c4a_kv"), std::string::npos) << s;
  EXPECT_NE(s.message().find("page_bytes 37440 on prefill vs 37376 on decode"), std::string::npos)
      << s;
  s = CheckCompatible(DeepSeekV4ProLayout(), DeepSeekV4FlashLayout());
  EXPECT_NE(s.message().find("swa_kv"), std::string::npos) << s;
  s = CheckCompatible(DeepSeekV3Layout(true), DeepSeekV3Layout(false));
  EXPECT_NE(s.message().find("indexer_k' exists on prefill but not on decode"), std::string::npos)
      << s;
  b = DeepSeekV4ProLayout();
  b.groups[0].window_tokens = 256;
  EXPECT_NE(CheckCompatible(a, b).message().find("window_tokens 128"), std::string::npos);
  MhaOptions o;
  Layout m1 = MhaLayout(o);
  o.kv_heads = 4;
  EXPECT_NE(CheckCompatible(m1, MhaLayout(o)).message().find("total kv heads 8"),
            std::string::npos);
  EXPECT_NE(CheckCompatible(m1, DeepSeekV3Layout()).message().find("'kv'"), std::string::npos);
}

TEST(LayoutTest, MhaTensorParallelMapping) {
  // Prefill TP=1 (8 heads) -> decode TP=2 rank 1 (heads 4..7), NHD pages: per-token runs.
  MhaOptions p;
  p.layers = 2;
  MhaOptions d = p;
  d.tp_size = 2;
  d.tp_rank = 1;
  Layout src = MhaLayout(p), dst = MhaLayout(d);
  AssignBacking(&src, 0, 16);
  AssignBacking(&dst, 1 << 20, 16);
  BlockTable st{{"kv", {3}}}, dt{{"kv", {7}}};
  absl::StatusOr<TransferPlan> plan = PlanTransfer(src, st, dst, dt, 16);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const uint64_t head = 128 * 2;
  EXPECT_EQ(plan->bytes, 2u * 2 * 16 * 4 * head);  // layers x K/V x tokens x 4 heads
  EXPECT_EQ(plan->ops_before_merge, 2u * 2 * 16);
  const ByteRange& r = plan->groups[0].ranges[0];
  EXPECT_EQ(r.src, src.groups[0].BlockAddress(0, 3, 0) + 4 * head);
  EXPECT_EQ(r.dst, dst.groups[0].BlockAddress(0, 7, 0));
  EXPECT_EQ(r.length, 4 * head);
  // Decode rows are contiguous but prefill rows are not: nothing merges.
  EXPECT_EQ(plan->ops_after_merge, plan->ops_before_merge);
  // HND pages, same TP: whole pages, K and V of block-major pages merge.
  p.heads_outer = true;
  p.block_major = true;
  Layout s2 = MhaLayout(p), d2 = MhaLayout(p);
  AssignBacking(&s2, 0, 16);
  AssignBacking(&d2, 1 << 20, 16);
  plan = PlanTransfer(s2, BlockTable{{"kv", {3}}}, d2, BlockTable{{"kv", {3}}}, 16);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->ops_before_merge, 2u * 2);
  EXPECT_EQ(plan->ops_after_merge, 2u);
}

TEST(LayoutTest, Dsv4Pro8kRequestBytes) {
  Layout src = DeepSeekV4ProLayout(), dst = DeepSeekV4ProLayout();
  AssignBacking(&src, 0, 256);
  AssignBacking(&dst, 0, 256);
  std::mt19937_64 rng(7);
  BlockTable st = Table(src, 8192, &rng, 256), dt = Table(dst, 8192, &rng, 256);
  absl::StatusOr<TransferPlan> plan = PlanTransfer(src, st, dst, dt, 8192);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const uint64_t expect = 2ull * 62 * 37440     // SWA: blocks 126, 127
                          + 32ull * 30 * 37440  // c4a: 2048 entries
                          + 32ull * 31 * 1728   // c128a: 64 entries
                          + 32ull * 30 * 8640   // indexer K
                          + 4ull * 30 * 8192    // c4a state: slots 8188..8191
                          + 4ull * 30 * 2048;   // indexer state; c128a state: none
  EXPECT_EQ(plan->bytes, expect);
}

TEST(LayoutTest, RandomPlansStayInsideBacking) {
  std::mt19937_64 rng(42);
  for (int iter = 0; iter < 200; ++iter) {
    Layout l = *PresetLayout(iter % 2 ? "deepseek-v4-flash" : "deepseek-v3.2");
    const uint64_t blocks = 64;
    const uint64_t sbytes = AssignBacking(&l, 0, blocks);
    Layout d = l;
    const uint64_t dbytes = AssignBacking(&d, 1ull << 40, blocks);
    const uint64_t n = 1 + rng() % 4000, cached = (rng() % 3 == 0) ? rng() % n : 0;
    absl::StatusOr<TransferPlan> plan =
        PlanTransfer(l, Table(l, n, &rng, blocks), d, Table(d, n, &rng, blocks), n, cached);
    ASSERT_TRUE(plan.ok()) << plan.status();
    uint64_t total = 0;
    for (const GroupPlan& g : plan->groups) {
      for (const ByteRange& r : g.ranges) {
        ASSERT_LE(r.src + r.length, sbytes);
        ASSERT_GE(r.dst, 1ull << 40);
        ASSERT_LE(r.dst + r.length, (1ull << 40) + dbytes);
        total += r.length;
      }
    }
    EXPECT_EQ(total, plan->bytes);
    EXPECT_LE(plan->ops_after_merge, plan->ops_before_merge);
  }
}

// --- rows a request did not fill (read grants clear them) -------------------------------

std::vector<PageSpan> Unfilled(const CacheGroup& g, uint64_t logical, uint64_t tokens) {
  absl::StatusOr<std::vector<PageSpan>> spans = UnfilledPageSpans(g, logical, tokens);
  EXPECT_TRUE(spans.ok()) << g.name << ": " << spans.status();
  return spans.ok() ? *spans : std::vector<PageSpan>{{999, 999}};
}

// DeepSeek-V4 pages (DESIGN.md 7): all 576-byte data rows, then all 8-byte scale rows, then
// padding up to a multiple of 576; the indexer K: 128-byte rows, then 4-byte scales.
TEST(UnfilledRowsTest, DeepSeekV4DataRowsThenScaleRows) {
  for (const Layout& l : {DeepSeekV4ProLayout(), DeepSeekV4FlashLayout()}) {
    SCOPED_TRACE(l.model);
    // 70 tokens: swa_kv block 1 holds 6 of 64 tokens.
    const CacheGroup& swa = G(l, "swa_kv");
    EXPECT_EQ(Unfilled(swa, 0, 70), std::vector<PageSpan>{});
    EXPECT_EQ(Unfilled(swa, 1, 70),
              (std::vector<PageSpan>{{6 * 576, 58 * 576}, {64 * 576 + 6 * 8, 58 * 8 + 64}}));
    EXPECT_EQ(Unfilled(swa, 2, 70), (std::vector<PageSpan>{{0, 37440}}));
    // c4a: 70 tokens are 17 complete entries (of 64 a block).
    EXPECT_EQ(Unfilled(G(l, "c4a_kv"), 0, 70),
              (std::vector<PageSpan>{{17 * 576, 47 * 576}, {64 * 576 + 17 * 8, 47 * 8 + 64}}));
    EXPECT_EQ(Unfilled(G(l, "c4a_kv"), 0, 256 * 4), std::vector<PageSpan>{});
    EXPECT_EQ(Unfilled(G(l, "c4a_indexer_k"), 0, 70),
              (std::vector<PageSpan>{{17 * 128, 47 * 128}, {64 * 128 + 17 * 4, 47 * 4 + 192}}));
    // c128a: 2 entries a block; 70 tokens complete none, 384 complete 3.
    const CacheGroup& c128 = G(l, "c128a_kv");
    EXPECT_EQ(Unfilled(c128, 0, 70), (std::vector<PageSpan>{{0, 1728}}));
    EXPECT_EQ(Unfilled(c128, 0, 384), std::vector<PageSpan>{});
    EXPECT_EQ(Unfilled(c128, 1, 384), (std::vector<PageSpan>{{576, 576}, {1152 + 8, 8 + 560}}));
    // Compressor rings, token-major slots (slot = token % ring): the slots past the request's
    // tokens, none once it had a whole ring.
    const CacheGroup& ring = G(l, "c128a_compressor_state");
    EXPECT_EQ(Unfilled(ring, 0, 70), (std::vector<PageSpan>{{70 * 4096, 58 * 4096}}));
    EXPECT_EQ(Unfilled(ring, 0, 200), std::vector<PageSpan>{});
    EXPECT_EQ(Unfilled(G(l, "c4a_compressor_state"), 0, 5),
              (std::vector<PageSpan>{{5 * 8192, 3 * 8192}}));
    EXPECT_EQ(Unfilled(G(l, "c4a_indexer_compressor_state"), 0, 70), std::vector<PageSpan>{});
  }
}

TEST(UnfilledRowsTest, DeepSeekV3TokenMajorAndIndexerSections) {
  Layout l = DeepSeekV3Layout(/*with_indexer=*/true);
  ASSERT_TRUE(l.Validate().ok());
  EXPECT_EQ(Unfilled(G(l, "mla_kv"), 1, 70), (std::vector<PageSpan>{{6 * 656, 58 * 656}}));
  EXPECT_EQ(Unfilled(G(l, "mla_kv"), 0, 70), std::vector<PageSpan>{});
  EXPECT_EQ(Unfilled(G(l, "indexer_k"), 1, 70),
            (std::vector<PageSpan>{{6 * 128, 58 * 128}, {64 * 128 + 6 * 4, 58 * 4}}));
}

// MHA: derived from the head split. NHD: a row is one token of every local head; HND: each
// local head's chunk holds its tokens' rows.
TEST(UnfilledRowsTest, MhaPlacementFromTheHeadSplit) {
  MhaOptions o;  // 8 heads of 128 x 2 bytes, 16 tokens a block
  const CacheGroup nhd = MhaLayout(o).groups[0];
  EXPECT_EQ(PageSections(nhd).value(), std::vector<uint64_t>{8 * 256});
  EXPECT_EQ(Unfilled(nhd, 1, 20), (std::vector<PageSpan>{{4 * 2048, 12 * 2048}}));
  EXPECT_EQ(Unfilled(nhd, 0, 20), std::vector<PageSpan>{});
  o.tp_size = 2;
  o.tp_rank = 1;
  const CacheGroup nhd_tp = MhaLayout(o).groups[0];
  EXPECT_EQ(Unfilled(nhd_tp, 1, 20), (std::vector<PageSpan>{{4 * 1024, 12 * 1024}}));
  o.tp_size = 1;
  o.tp_rank = 0;
  o.heads_outer = true;
  const CacheGroup hnd = MhaLayout(o).groups[0];
  EXPECT_EQ(PageSections(hnd).value(), std::vector<uint64_t>(8, 256));
  std::vector<PageSpan> want;
  for (uint64_t h = 0; h < 8; ++h) want.push_back({h * 16 * 256 + 4 * 256, 12 * 256});
  EXPECT_EQ(Unfilled(hnd, 1, 20), want);
  EXPECT_EQ(Unfilled(hnd, 3, 20), (std::vector<PageSpan>{{0, 8 * 16 * 256}}));
}

// A replicated history group whose placement nobody gave is not guessed (a DeepSeek-V4 page
// of 37,440 bytes divides by 64 rows, yet is not token-major): a partly filled block of it is
// an error naming the group and the field; full and untouched blocks need no placement.
TEST(UnfilledRowsTest, UnknownPlacementIsAnErrorNotAGuess) {
  CacheGroup g = G(DeepSeekV4ProLayout(), "swa_kv");
  g.section_row_bytes.clear();
  absl::StatusOr<std::vector<PageSpan>> partly = UnfilledPageSpans(g, 1, 70);
  ASSERT_FALSE(partly.ok());
  EXPECT_EQ(partly.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(partly.status().message().find("'swa_kv'"), std::string::npos) << partly.status();
  EXPECT_NE(partly.status().message().find("section_row_bytes"), std::string::npos);
  EXPECT_EQ(Unfilled(g, 0, 70), std::vector<PageSpan>{});
  EXPECT_EQ(Unfilled(g, 2, 70), (std::vector<PageSpan>{{0, g.page_bytes}}));
}

TEST(UnfilledRowsTest, ValidateChecksTheSections) {
  Layout l = DeepSeekV4ProLayout();
  l.groups[0].section_row_bytes = {585, 8};  // 64 x 593 > 37,440
  EXPECT_FALSE(l.Validate().ok());
  l.groups[0].section_row_bytes = {576, 0};
  EXPECT_FALSE(l.Validate().ok());
  l.groups[0].section_row_bytes = {576, 9};  // 64 x 585 = 37,440: fits exactly
  EXPECT_TRUE(l.Validate().ok());
  l.groups[0].section_row_bytes = std::vector<uint64_t>(4097, 1);
  EXPECT_FALSE(l.Validate().ok());
  // Carried by JSON.
  l.groups[0].section_row_bytes = {576, 8};
  absl::StatusOr<Layout> back = LayoutFromJson(LayoutToJson(l));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->groups[0].section_row_bytes, (std::vector<uint64_t>{576, 8}));
  EXPECT_EQ(G(*back, "c4a_indexer_k").section_row_bytes, (std::vector<uint64_t>{128, 4}));
}

// Every preset, any request length and block: the unfilled spans and the rows the request
// filled (by the DESIGN's placement, written out here per row) cover the page exactly once.
TEST(UnfilledRowsTest, UnfilledAndFilledRowsPartitionEveryPage) {
  std::mt19937_64 rng(7);
  for (const char* name :
       {"deepseek-v4-pro", "deepseek-v4-flash", "deepseek-v3", "deepseek-v3.2", "mha"}) {
    Layout l = PresetLayout(name).value();
    for (const CacheGroup& g : l.groups) {
      absl::StatusOr<std::vector<uint64_t>> sections = PageSections(g);
      ASSERT_TRUE(sections.ok()) << name << " " << g.name << ": " << sections.status();
      for (int trial = 0; trial < 20; ++trial) {
        const uint64_t tokens = 1 + rng() % 1000;
        const uint64_t logical = g.per_request_state ? 0 : rng() % 5;
        std::vector<int> cover(g.page_bytes, 0);
        for (const PageSpan& s : Unfilled(g, logical, tokens)) {
          ASSERT_LE(s.offset + s.length, g.page_bytes);
          for (uint64_t i = s.offset; i < s.offset + s.length; ++i) ++cover[i];
        }
        const uint64_t rows = g.rows_per_block();
        bool full = true;
        uint64_t section_at = 0;
        for (uint64_t row_bytes : *sections) {
          for (uint64_t r = 0; r < rows; ++r) {
            // Row r holds token slot r (state), or entry logical * rows + r.
            const bool filled =
                g.per_request_state
                    ? r < tokens
                    : (logical * rows + r + 1) * static_cast<uint64_t>(g.tokens_per_entry) <=
                          tokens;
            full = full && filled;
            if (!filled) continue;
            for (uint64_t i = 0; i < row_bytes; ++i) ++cover[section_at + r * row_bytes + i];
          }
          section_at += rows * row_bytes;
        }
        // The padding after the sections is cleared with the rows of a partly filled block.
        for (uint64_t i = section_at; i < g.page_bytes; ++i) cover[i] += full ? 1 : 0;
        for (uint64_t i = 0; i < g.page_bytes; ++i) {
          ASSERT_EQ(cover[i], 1) << name << " " << g.name << " byte " << i << " of block "
                                 << logical << ", " << tokens << " tokens";
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvwire
