// The transfer contract: a decode instance that receives exactly the bytes
// kvwire::PlanTransfer lists (full-history blocks, SWA blocks in the window, the unfinished
// compression windows of the state rings) computes bit-identically to the instance that ran
// the prompt. Everything else in the receiving cache is poisoned (NaN fp8 codes, huge
// floats), so a read outside the contract shows up in the logits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "examples/dsv4/model/kv_cache.h"
#include "examples/dsv4/model/model.h"
#include "kvwire/layout.h"
#include "tests/dsv4/model/tiny_model.h"

namespace dsv4 {
namespace {

constexpr int kDecodeSteps = 3;

std::unique_ptr<KvCache> PoisonedCache(uint64_t seed) {
  absl::StatusOr<std::unique_ptr<KvCache>> c =
      KvCache::Create(TinyModelFiles::Get().config(), 8, 2, seed);
  EXPECT_TRUE(c.ok()) << c.status();
  for (const kvwire::KvMemory& m : (*c)->memory()) std::memset(m.ptr, 0x7F, m.length);
  return std::move(*c);
}

// Copies the planned ranges from A to B; returns the plan.
kvwire::TransferPlan Transfer(const KvCache& a, const kvwire::BlockTable& ta, const KvCache& b,
                              const kvwire::BlockTable& tb, uint64_t tokens) {
  absl::StatusOr<kvwire::TransferPlan> plan =
      kvwire::PlanTransfer(a.layout(), ta, b.layout(), tb, tokens);
  EXPECT_TRUE(plan.ok()) << plan.status();
  for (const kvwire::GroupPlan& g : plan->groups) {
    for (const kvwire::ByteRange& r : g.ranges) {
      std::memcpy(reinterpret_cast<void*>(r.dst), reinterpret_cast<const void*>(r.src), r.length);
    }
  }
  return *plan;
}

bool Same(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
}

struct Observed {
  uint64_t checkpoint;  // prompt length transferred
  uint64_t tokens;      // logits after this many tokens
  std::vector<float> logits;
};

// Prompt lengths crossing the 4-, 64-, 128- and 256-token boundaries.
TEST(TransferContractTest, DecodeAfterTransferIsBitIdentical) {
  const std::vector<uint64_t> lengths = {1, 3, 4, 5, 127, 128, 129, 255, 256, 257, 300};
  const uint64_t last = lengths.back() + kDecodeSteps;
  const std::vector<int32_t> seq = TestPrompt(static_cast<int>(last), 5);
  std::unique_ptr<Model> model = TinyModelFiles::Get().Load(2);
  auto a = PoisonedCache(1);
  absl::StatusOr<kvwire::BlockTable> ta = a->Allocate(last);
  ASSERT_TRUE(ta.ok()) << ta.status();
  // A runs the sequence once, stopping at every checkpoint and at the decode steps after it
  // (chunked prefill is bit-identical to one-shot, see ModelTest); logits_a[n] are the
  // logits after n tokens.
  std::set<uint64_t> stops;
  for (uint64_t n : lengths) {
    for (int k = 0; k <= kDecodeSteps; ++k) stops.insert(n + k);
  }
  std::map<uint64_t, std::vector<float>> logits_a;
  std::vector<Observed> observed;
  uint64_t pos = 0;
  for (uint64_t stop : stops) {
    absl::StatusOr<std::vector<float>> l =
        model->Forward(*a, *ta, std::span<const int32_t>(seq).subspan(pos, stop - pos), pos);
    ASSERT_TRUE(l.ok()) << l.status();
    pos = stop;
    logits_a[stop] = *l;
    if (std::find(lengths.begin(), lengths.end(), stop) == lengths.end()) continue;
    // Prompt of `stop` tokens done in A: move it to a fresh, poisoned B with other block ids.
    auto b = PoisonedCache(1000 + stop);
    absl::StatusOr<kvwire::BlockTable> tb = b->Allocate(stop + kDecodeSteps);
    ASSERT_TRUE(tb.ok()) << tb.status();
    Transfer(*a, *ta, *b, *tb, stop);
    // Whole SWA blocks move, so B also got records just before the window; poison them so
    // that a read one token past the window shows too.
    const kvwire::CacheGroup* swa = b->layout().FindGroup("swa_kv");
    const int64_t outside = static_cast<int64_t>(stop) - 128;  // newest token out of window
    for (int64_t tok = outside < 0 ? 0 : outside / 64 * 64; tok <= outside; ++tok) {
      for (int layer : swa->layers) {
        uint8_t* page = b->Page("swa_kv", layer, tb->at("swa_kv")[tok / 64]);
        std::memset(page + (tok % 64) * 576, 0x7F, 576);
        std::memset(page + 64 * 576 + (tok % 64) * 8, 0x7F, 8);
      }
    }
    // The rows kvwire clears before a read grant (UnfilledPageSpans: what a prompt of `stop`
    // tokens did not fill) are rows the prompt never wrote (A's are still poison) and rows the
    // decode never reads before writing them (poisoned in B, the logits stay bit-identical).
    for (const kvwire::CacheGroup& g : b->layout().groups) {
      absl::StatusOr<std::vector<uint64_t>> sections = kvwire::PageSections(g);
      ASSERT_TRUE(sections.ok()) << sections.status();
      const uint64_t rows = g.rows_per_block();
      for (size_t lb = 0; lb < tb->at(g.name).size() && lb < ta->at(g.name).size(); ++lb) {
        absl::StatusOr<std::vector<kvwire::PageSpan>> spans =
            kvwire::UnfilledPageSpans(g, lb, stop);
        ASSERT_TRUE(spans.ok()) << spans.status();
        std::vector<bool> unfilled(g.page_bytes, false);
        for (const kvwire::PageSpan& s : *spans) {
          std::fill(unfilled.begin() + s.offset, unfilled.begin() + s.offset + s.length, true);
        }
        for (int layer : g.layers) {
          const uint8_t* pa = a->Page(g.name, layer, ta->at(g.name)[lb]);
          uint64_t at = 0;
          for (uint64_t row : *sections) {
            for (uint64_t r = 0; r < rows; ++r, at += row) {
              if (unfilled[at]) continue;
              // A filled row: written by the prompt, so not all poison.
              const bool poison =
                  std::all_of(pa + at, pa + at + row, [](uint8_t x) { return x == 0x7F; });
              EXPECT_FALSE(poison)
                  << g.name << " layer " << layer << " logical block " << lb << " row " << r
                  << ": counted as filled by " << stop << " tokens, never written";
            }
          }
          uint8_t* pb = b->Page(g.name, layer, tb->at(g.name)[lb]);
          for (const kvwire::PageSpan& s : *spans) std::memset(pb + s.offset, 0x7F, s.length);
        }
      }
    }
    for (int k = 0; k < kDecodeSteps; ++k) {
      const uint64_t p = stop + k;
      absl::StatusOr<std::vector<float>> lb =
          model->Forward(*b, *tb, std::span<const int32_t>(seq).subspan(p, 1), p);
      ASSERT_TRUE(lb.ok()) << lb.status();
      observed.push_back({stop, p + 1, *lb});
    }
  }
  ASSERT_EQ(observed.size(), lengths.size() * kDecodeSteps);
  for (const Observed& o : observed) {
    ASSERT_TRUE(logits_a.count(o.tokens));
    for (float x : o.logits) {
      ASSERT_TRUE(std::isfinite(x))
          << "poison read: prompt " << o.checkpoint << ", logits after " << o.tokens << " tokens";
    }
    EXPECT_TRUE(Same(logits_a[o.tokens], o.logits))
        << "prompt of " << o.checkpoint << " tokens: logits after " << o.tokens << " differ";
  }
}

// The check above is sensitive: one corrupted page of a transferred group changes what
// decode computes. Paged groups change the logits; a corrupted compressor ring changes the
// next compressed entry (c128a entries are attended without selection, so the logits too).
TEST(TransferContractTest, CorruptingOneTransferredPageIsDetected) {
  struct Case {
    const char* group;
    uint64_t prompt;
    int entry_ratio;        // state groups: the ratio of the entry the ring feeds
    const char* out_group;  // state groups: where that entry lands
  };
  const Case cases[] = {
      {"swa_kv", 257, 0, nullptr},
      {"c4a_kv", 257, 0, nullptr},
      {"c128a_kv", 257, 0, nullptr},
      {"c4a_indexer_k", 257, 0, nullptr},
      {"c4a_compressor_state", 257, 4, "c4a_kv"},
      {"c4a_indexer_compressor_state", 257, 4, "c4a_indexer_k"},
      {"c128a_compressor_state", 127, 128, "c128a_kv"},
  };
  std::unique_ptr<Model> model = TinyModelFiles::Get().Load(2);
  // One prefill per prompt length; each case decodes a clean and a corrupted copy of it.
  std::map<uint64_t, std::pair<std::unique_ptr<KvCache>, kvwire::BlockTable>> prefilled;
  for (const Case& c : cases) {
    if (prefilled.count(c.prompt)) continue;
    const std::vector<int32_t> seq = TestPrompt(static_cast<int>(c.prompt), 9);
    auto a = PoisonedCache(1);
    absl::StatusOr<kvwire::BlockTable> ta = a->Allocate(seq.size());
    ASSERT_TRUE(ta.ok());
    ASSERT_TRUE(model->Forward(*a, *ta, seq, 0).ok());
    prefilled[c.prompt] = {std::move(a), *ta};
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.group);
    const std::vector<int32_t> seq = TestPrompt(static_cast<int>(c.prompt) + kDecodeSteps, 9);
    const auto& [a, ta] = prefilled[c.prompt];
    auto clean = PoisonedCache(2);
    auto bad = PoisonedCache(3);
    absl::StatusOr<kvwire::BlockTable> tc = clean->Allocate(seq.size());
    absl::StatusOr<kvwire::BlockTable> tb = bad->Allocate(seq.size());
    ASSERT_TRUE(tc.ok() && tb.ok());
    Transfer(*a, ta, *clean, *tc, c.prompt);
    kvwire::TransferPlan plan = Transfer(*a, ta, *bad, *tb, c.prompt);
    // Corrupt the last transferred page of the group's last layer (one bit per byte).
    const kvwire::GroupPlan* gp = nullptr;
    for (const kvwire::GroupPlan& g : plan.groups) {
      if (g.group == c.group) gp = &g;
    }
    ASSERT_NE(gp, nullptr);
    ASSERT_FALSE(gp->ranges.empty());
    const kvwire::ByteRange& r = gp->ranges.back();
    const uint64_t page = bad->layout().FindGroup(c.group)->page_bytes;
    const uint64_t len = std::min(r.length, page);
    uint8_t* dst = reinterpret_cast<uint8_t*>(r.dst + r.length - len);
    for (uint64_t i = 0; i < len; ++i) dst[i] ^= 0x40;
    bool logits_differ = false;
    for (int k = 0; k < kDecodeSteps; ++k) {
      const uint64_t p = c.prompt + k;
      auto one = std::span<const int32_t>(seq).subspan(p, 1);
      absl::StatusOr<std::vector<float>> lc = model->Forward(*clean, *tc, one, p);
      absl::StatusOr<std::vector<float>> lb = model->Forward(*bad, *tb, one, p);
      ASSERT_TRUE(lc.ok() && lb.ok());
      logits_differ |= !Same(*lc, *lb);
    }
    if (c.out_group == nullptr || c.entry_ratio == 128) {
      EXPECT_TRUE(logits_differ);
    }
    if (c.out_group != nullptr) {
      // The entry completed during decode: j = the first entry ending at or after the prompt.
      const int ratio = c.entry_ratio;
      const uint64_t j = c.prompt / ratio;
      ASSERT_LE((j + 1) * ratio, c.prompt + kDecodeSteps);
      const kvwire::CacheGroup* g = clean->layout().FindGroup(c.out_group);
      const uint64_t logical = j * ratio / g->tokens_per_block;
      const int layer = g->layers.back();
      const uint8_t* pc = clean->Page(c.out_group, layer, tc->at(c.out_group)[logical]);
      const uint8_t* pb = bad->Page(c.out_group, layer, tb->at(c.out_group)[logical]);
      EXPECT_NE(std::memcmp(pc, pb, g->page_bytes), 0) << "entry " << j << " unchanged";
    }
  }
}

}  // namespace
}  // namespace dsv4
