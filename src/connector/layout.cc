// Cache groups, presets, block selection and byte-range planning.
#include "kvwire/layout.h"

#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "kvwire/deepseek.h"

namespace kvwire {
namespace {

uint64_t RoundUp(uint64_t v, uint64_t align) { return (v + align - 1) / align * align; }

std::vector<int> Range(int begin, int end, int step = 1) {
  std::vector<int> out;
  for (int i = begin; i < end; i += step) out.push_back(i);
  return out;
}

CacheGroup Group(std::string name, std::vector<int> layers, int tokens_per_block,
                 uint64_t page_bytes, int tokens_per_entry, int window_tokens, bool state) {
  CacheGroup g;
  g.name = std::move(name);
  g.layers = std::move(layers);
  g.tokens_per_block = tokens_per_block;
  g.page_bytes = page_bytes;
  g.tokens_per_entry = tokens_per_entry;
  g.window_tokens = window_tokens;
  g.per_request_state = state;
  return g;
}

// DeepSeek-V4 layers with compress_ratios c4a / c128a / window-only.
Layout Dsv4Layout(std::string model, const std::vector<int>& window_only,
                  const std::vector<int>& c4a, const std::vector<int>& c128a, int mtp_layers) {
  Layout layout;
  layout.model = std::move(model);
  std::vector<int> all;
  for (const auto* v : {&window_only, &c4a, &c128a}) all.insert(all.end(), v->begin(), v->end());
  std::sort(all.begin(), all.end());
  const int main_layers = static_cast<int>(all.size());
  for (int i = 0; i < mtp_layers; ++i) all.push_back(main_layers + i);
  const uint64_t state_float = 4;
  layout.groups.push_back(Group("swa_kv", all, 64, Dsv4PageBytes(64), 1, 128, false));
  layout.groups.push_back(Group("c4a_kv", c4a, 256, Dsv4PageBytes(64), 4, 0, false));
  layout.groups.push_back(Group("c128a_kv", c128a, 256, Dsv4PageBytes(2), 128, 0, false));
  layout.groups.push_back(Group("c4a_indexer_k", c4a, 256, Dsv4PageBytes(64, 132), 4, 0, false));
  // Inside a page: all 576-byte data rows, then all 8-byte scale rows (indexer K: 128-byte
  // fp8 rows, then 4-byte fp32 scales), then padding up to a multiple of 576. (The compressor
  // states below are token-major rings, which PageSections derives.)
  for (CacheGroup& g : layout.groups) {
    g.section_row_bytes =
        g.name == "c4a_indexer_k" ? std::vector<uint64_t>{128, 4} : std::vector<uint64_t>{576, 8};
  }
  // Compressor states: one ring per request; c4a windows overlap (8 tokens, stride 4).
  layout.groups.push_back(
      Group("c4a_compressor_state", c4a, 8, 8 * 2048 * state_float, 4, 8, true));
  layout.groups.push_back(
      Group("c128a_compressor_state", c128a, 128, 128 * 1024 * state_float, 128, 128, true));
  layout.groups.push_back(
      Group("c4a_indexer_compressor_state", c4a, 8, 8 * 512 * state_float, 4, 8, true));
  return layout;
}

absl::Status GroupError(const CacheGroup& g, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("cache group '", g.name, "': ", what));
}

}  // namespace

uint64_t CacheGroup::BlockAddress(size_t layer_index, uint64_t block, int component) const {
  return layer_base[layer_index] + block * block_stride +
         static_cast<uint64_t>(component) * component_stride;
}

const CacheGroup* Layout::FindGroup(const std::string& name) const {
  for (const CacheGroup& g : groups) {
    if (g.name == name) return &g;
  }
  return nullptr;
}

absl::Status Layout::Validate() const {
  std::set<std::string> names;
  for (const CacheGroup& g : groups) {
    if (g.name.empty()) return absl::InvalidArgumentError("cache group without a name");
    if (!names.insert(g.name).second) return GroupError(g, "duplicate group name");
    if (g.layers.empty()) return GroupError(g, "no layers");
    if (g.tokens_per_block <= 0) return GroupError(g, "tokens_per_block must be > 0");
    if (g.tokens_per_entry <= 0 || g.tokens_per_block % g.tokens_per_entry != 0) {
      return GroupError(g, absl::StrCat("tokens_per_entry ", g.tokens_per_entry,
                                        " must divide tokens_per_block ", g.tokens_per_block));
    }
    if (g.page_bytes == 0) return GroupError(g, "page_bytes must be > 0");
    if (g.window_tokens < 0) return GroupError(g, "window_tokens must be >= 0");
    if (g.components != 1 && g.components != 2) return GroupError(g, "components must be 1 or 2");
    if (g.per_request_state) {
      if (g.window_tokens <= 0 || g.window_tokens > g.tokens_per_block) {
        return GroupError(g, absl::StrCat("state ring of ", g.window_tokens,
                                          " tokens must fit the ", g.tokens_per_block, " slots"));
      }
      if (g.page_bytes % g.tokens_per_block != 0) {
        return GroupError(g, "state page_bytes must be a multiple of the slot count");
      }
      if (g.heads.total_heads != 0) return GroupError(g, "state groups cannot split heads");
    }
    const HeadSplit& h = g.heads;
    if (h.total_heads < 0) return GroupError(g, "total_heads must be >= 0");
    if (h.total_heads > 0) {
      if (h.tp_size <= 0 || h.total_heads % h.tp_size != 0 || h.tp_rank < 0 ||
          h.tp_rank >= h.tp_size) {
        return GroupError(g, absl::StrCat("bad head split: ", h.total_heads, " heads, tp ",
                                          h.tp_rank, "/", h.tp_size));
      }
      const uint64_t local = h.total_heads / h.tp_size;
      if (h.outer * local * h.inner_bytes != g.page_bytes) {
        return GroupError(
            g, absl::StrCat("page_bytes ", g.page_bytes, " != outer ", h.outer, " x local heads ",
                            local, " x head bytes ", h.inner_bytes));
      }
    }
    if (!g.section_row_bytes.empty()) {
      constexpr size_t kMaxSections = 4096;
      if (g.section_row_bytes.size() > kMaxSections) {
        return GroupError(g, absl::StrCat(g.section_row_bytes.size(), " page sections (at most ",
                                          kMaxSections, ")"));
      }
      // Each term is at most page_bytes, and the sum stops past it: no overflow.
      uint64_t row = 0;
      for (uint64_t b : g.section_row_bytes) {
        if (b == 0 || b > g.page_bytes) {
          return GroupError(g, "section_row_bytes must be > 0 and at most page_bytes");
        }
        row += b;
        if (row > g.page_bytes) break;
      }
      if (row > g.page_bytes || g.rows_per_block() > g.page_bytes / row) {
        return GroupError(
            g, absl::StrCat("page sections of ", row, " bytes per row x ", g.rows_per_block(),
                            " rows exceed page_bytes ", g.page_bytes));
      }
    }
    if (!g.layer_base.empty() || g.num_blocks != 0) {
      if (g.layer_base.size() != g.layers.size()) {
        return GroupError(
            g, absl::StrCat(g.layer_base.size(), " layer bases for ", g.layers.size(), " layers"));
      }
      if (g.num_blocks == 0) return GroupError(g, "backed group with 0 blocks");
      if (g.block_stride < g.page_bytes) return GroupError(g, "block_stride < page_bytes");
      if (g.components == 2 && g.component_stride < g.page_bytes) {
        return GroupError(g, "component_stride < page_bytes");
      }
    }
  }
  return absl::OkStatus();
}

uint64_t Dsv4PageBytes(uint64_t entries, uint64_t record_bytes) {
  return RoundUp(entries * record_bytes, kDsv4PageAlign);
}

Layout DeepSeekV4ProLayout() {
  // 61 layers: 31 c128a (even) and 30 c4a (odd), plus one window-only MTP layer.
  return Dsv4Layout("deepseek-v4-pro", {}, Range(1, 61, 2), Range(0, 61, 2), 1);
}

Layout DeepSeekV4Layout(std::string model, const std::vector<int>& compress_ratios,
                        int mtp_layers) {
  std::vector<int> window_only, c4a, c128a;
  for (size_t i = 0; i < compress_ratios.size(); ++i) {
    const int layer = static_cast<int>(i);
    if (compress_ratios[i] == 4) {
      c4a.push_back(layer);
    } else if (compress_ratios[i] == 128) {
      c128a.push_back(layer);
    } else {
      window_only.push_back(layer);
    }
  }
  return Dsv4Layout(std::move(model), window_only, c4a, c128a, mtp_layers);
}

Layout DeepSeekV4FlashLayout() {
  // 43 layers: 0-1 window-only, then alternating c4a / c128a from layer 2.
  return Dsv4Layout("deepseek-v4-flash", {0, 1}, Range(2, 43, 2), Range(3, 43, 2), 0);
}

Layout DeepSeekV3Layout(bool with_indexer, int tokens_per_block) {
  Layout layout;
  layout.model = with_indexer ? "deepseek-v3.2" : "deepseek-v3";
  const uint64_t tpb = tokens_per_block;
  // 512 fp8 latent + 4 fp32 scales + 64 bf16 RoPE = 656 bytes per token.
  layout.groups.push_back(Group("mla_kv", Range(0, 61), tokens_per_block, 656 * tpb, 1, 0, false));
  layout.groups.back().section_row_bytes = {656};  // token-major
  if (with_indexer) {
    // As vLLM's DeepSeek-V3.2 indexer cache: all 128-byte fp8 keys, then their fp32 scales.
    layout.groups.push_back(
        Group("indexer_k", Range(0, 61), tokens_per_block, 132 * tpb, 1, 0, false));
    layout.groups.back().section_row_bytes = {128, 4};
  }
  return layout;
}

Layout MhaLayout(const MhaOptions& o) {
  Layout layout;
  layout.model = "mha";
  const uint64_t head_bytes = static_cast<uint64_t>(o.head_dim) * o.dtype_bytes;
  const uint64_t local_heads = o.kv_heads / std::max(1, o.tp_size);
  CacheGroup g = Group("kv", Range(0, o.layers), o.tokens_per_block,
                       o.tokens_per_block * local_heads * head_bytes, 1, 0, false);
  g.components = 2;
  g.block_major = o.block_major;
  g.heads.total_heads = o.kv_heads;
  g.heads.tp_size = o.tp_size;
  g.heads.tp_rank = o.tp_rank;
  g.heads.outer = o.heads_outer ? 1 : o.tokens_per_block;
  g.heads.inner_bytes = o.heads_outer ? head_bytes * o.tokens_per_block : head_bytes;
  layout.groups.push_back(std::move(g));
  return layout;
}

absl::StatusOr<Layout> PresetLayout(const std::string& name) {
  if (name == "deepseek-v4-pro") return DeepSeekV4ProLayout();
  if (name == "deepseek-v4-flash") return DeepSeekV4FlashLayout();
  if (name == "deepseek-v3") return DeepSeekV3Layout(false);
  if (name == "deepseek-v3.2") return DeepSeekV3Layout(true);
  if (name == "mha") return MhaLayout(MhaOptions());
  return absl::NotFoundError(absl::StrCat(
      "unknown layout preset '", name,
      "' (known: deepseek-v4-pro, deepseek-v4-flash, deepseek-v3, deepseek-v3.2, mha)"));
}

uint64_t AssignBacking(Layout* layout, uint64_t base, uint64_t all_blocks, uint64_t state_blocks) {
  uint64_t offset = 0;
  for (CacheGroup& g : layout->groups) {
    const uint64_t num_blocks =
        g.per_request_state && state_blocks != 0 ? state_blocks : all_blocks;
    g.num_blocks = num_blocks;
    if (g.components == 2 && !g.block_major) {
      g.block_stride = g.page_bytes;
      g.component_stride = num_blocks * g.page_bytes;
    } else {
      g.block_stride = g.page_bytes * g.components;
      g.component_stride = g.components == 2 ? g.page_bytes : 0;
    }
    const uint64_t layer_bytes = num_blocks * g.page_bytes * g.components;
    g.layer_base.clear();
    for (size_t l = 0; l < g.layers.size(); ++l) {
      g.layer_base.push_back(base + offset);
      offset += RoundUp(layer_bytes, 64);
    }
  }
  return offset;
}

// --- mapping ----------------------------------------------------------------------------

BlockSelection SelectBlocks(const CacheGroup& g, uint64_t num_tokens, uint64_t num_cached) {
  BlockSelection sel;
  if (num_cached >= num_tokens) return sel;
  const uint64_t ratio = g.tokens_per_entry;
  const uint64_t tpb = g.tokens_per_block;
  if (g.per_request_state) {
    // The unfinished compression window: tokens after the last complete entry, plus the
    // overlap the next entry needs (ring - ratio tokens before it).
    const uint64_t done = num_tokens / ratio * ratio;
    const uint64_t back =
        static_cast<uint64_t>(g.window_tokens) - std::min<uint64_t>(ratio, g.window_tokens);
    const uint64_t begin = done > back ? done - back : 0;
    sel.slot_count = num_tokens - begin;
    if (sel.slot_count == 0) return sel;
    sel.slot_begin = begin % tpb;
    sel.logical_blocks.push_back(0);
    return sel;
  }
  uint64_t begin = num_cached;
  if (g.window_tokens > 0 && num_tokens > static_cast<uint64_t>(g.window_tokens)) {
    begin = std::max<uint64_t>(begin, num_tokens - g.window_tokens);
  }
  const uint64_t end = ratio == 1 ? num_tokens : num_tokens / ratio * ratio;  // whole entries
  if (end <= begin) return sel;
  for (uint64_t b = begin / tpb; b <= (end - 1) / tpb; ++b) sel.logical_blocks.push_back(b);
  return sel;
}

std::vector<ByteRange> MergeRanges(const std::vector<ByteRange>& ranges) {
  std::vector<ByteRange> out;
  out.reserve(ranges.size());
  for (const ByteRange& r : ranges) {
    if (r.length == 0) continue;
    if (!out.empty() && out.back().src + out.back().length == r.src &&
        out.back().dst + out.back().length == r.dst) {
      out.back().length += r.length;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

std::vector<ByteRange> TransferPlan::LayerRanges(int layer) const {
  std::vector<ByteRange> out;
  for (const GroupPlan& g : groups) {
    size_t begin = 0;
    for (size_t i = 0; i < g.layers.size(); ++i) {
      if (g.layers[i] == layer) {
        out.insert(out.end(), g.ranges.begin() + begin, g.ranges.begin() + g.layer_end[i]);
      }
      begin = g.layer_end[i];
    }
  }
  return out;
}

std::vector<int> TransferPlan::Layers() const {
  std::set<int> layers;
  for (const GroupPlan& g : groups) layers.insert(g.layers.begin(), g.layers.end());
  return {layers.begin(), layers.end()};
}

absl::Status CheckCompatible(const Layout& src, const Layout& dst) {
  auto mismatch = [](const CacheGroup& g, const std::string& what, const auto& a, const auto& b) {
    return absl::FailedPreconditionError(absl::StrCat("layout mismatch in cache group '", g.name,
                                                      "': ", what, " ", a, " on prefill vs ", b,
                                                      " on decode"));
  };
  for (const CacheGroup& s : src.groups) {
    const CacheGroup* d = dst.FindGroup(s.name);
    if (d == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("layout mismatch: cache group '", s.name,
                                                        "' exists on prefill but not on decode"));
    }
    if (s.layers != d->layers) {
      return mismatch(s, "layers", absl::StrJoin(s.layers, ","), absl::StrJoin(d->layers, ","));
    }
    if (s.tokens_per_block != d->tokens_per_block) {
      return mismatch(s, "tokens_per_block", s.tokens_per_block, d->tokens_per_block);
    }
    if (s.tokens_per_entry != d->tokens_per_entry) {
      return mismatch(s, "tokens_per_entry", s.tokens_per_entry, d->tokens_per_entry);
    }
    if (s.window_tokens != d->window_tokens) {
      return mismatch(s, "window_tokens", s.window_tokens, d->window_tokens);
    }
    if (s.per_request_state != d->per_request_state) {
      return mismatch(s, "per_request_state", s.per_request_state, d->per_request_state);
    }
    if (s.components != d->components) {
      return mismatch(s, "components", s.components, d->components);
    }
    const HeadSplit& hs = s.heads;
    const HeadSplit& hd = d->heads;
    if ((hs.total_heads == 0) != (hd.total_heads == 0)) {
      return mismatch(s, "head split (total heads)", hs.total_heads, hd.total_heads);
    }
    if (hs.total_heads == 0) {
      if (s.page_bytes != d->page_bytes)
        return mismatch(s, "page_bytes", s.page_bytes, d->page_bytes);
    } else {
      if (hs.total_heads != hd.total_heads) {
        return mismatch(s, "total kv heads", hs.total_heads, hd.total_heads);
      }
      if (hs.outer != hd.outer) return mismatch(s, "page rows (outer)", hs.outer, hd.outer);
      if (hs.inner_bytes != hd.inner_bytes) {
        return mismatch(s, "bytes per head row", hs.inner_bytes, hd.inner_bytes);
      }
    }
  }
  for (const CacheGroup& d : dst.groups) {
    if (src.FindGroup(d.name) == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("layout mismatch: cache group '", d.name,
                                                        "' exists on decode but not on prefill"));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<uint64_t> LookupBlock(const CacheGroup& g, const BlockTable& table, const char* side,
                                     uint64_t logical) {
  auto it = table.find(g.name);
  if (it == table.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(side, " block table has no entry for cache group '", g.name, "'"));
  }
  if (logical >= it->second.size() || it->second[logical] < 0) {
    return absl::InvalidArgumentError(absl::StrCat(side, " block table of cache group '", g.name,
                                                   "' lacks logical block ", logical, " (",
                                                   it->second.size(), " entries)"));
  }
  const uint64_t id = static_cast<uint64_t>(it->second[logical]);
  if (id >= g.num_blocks) {
    return absl::OutOfRangeError(absl::StrCat(side, " block ", id, " of cache group '", g.name,
                                              "' is past its ", g.num_blocks, " blocks"));
  }
  return id;
}

}  // namespace

absl::StatusOr<TransferPlan> PlanTransfer(const Layout& src, const BlockTable& src_blocks,
                                          const Layout& dst, const BlockTable& dst_blocks,
                                          uint64_t num_tokens, uint64_t num_cached_tokens) {
  if (absl::Status s = CheckCompatible(src, dst); !s.ok()) return s;
  TransferPlan plan;
  for (const CacheGroup& s : src.groups) {
    const CacheGroup& d = *dst.FindGroup(s.name);
    if (s.layer_base.size() != s.layers.size() || d.layer_base.size() != d.layers.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cache group '", s.name, "' has no backing memory on ",
                       s.layer_base.size() != s.layers.size() ? "prefill" : "decode"));
    }
    GroupPlan gp;
    gp.group = s.name;
    const BlockSelection sel = SelectBlocks(s, num_tokens, num_cached_tokens);
    gp.blocks = sel.logical_blocks.size();
    // Pieces of one page: (src offset, dst offset, length).
    std::vector<ByteRange> pieces;
    if (s.per_request_state) {
      const uint64_t slot = s.page_bytes / s.tokens_per_block;
      uint64_t first = sel.slot_begin;
      uint64_t left = sel.slot_count;
      while (left > 0) {
        const uint64_t n = std::min<uint64_t>(left, s.tokens_per_block - first);
        pieces.push_back({first * slot, first * slot, n * slot});
        left -= n;
        first = 0;
      }
    } else if (s.heads.total_heads == 0) {
      pieces.push_back({0, 0, s.page_bytes});
    } else {
      const HeadSplit& hs = s.heads;
      const HeadSplit& hd = d.heads;
      const uint64_t sl = hs.total_heads / hs.tp_size, dl = hd.total_heads / hd.tp_size;
      const uint64_t s_lo = hs.tp_rank * sl, d_lo = hd.tp_rank * dl;
      const uint64_t lo = std::max(s_lo, d_lo), hi = std::min(s_lo + sl, d_lo + dl);
      for (uint64_t o = 0; lo < hi && o < hs.outer; ++o) {
        pieces.push_back({(o * sl + lo - s_lo) * hs.inner_bytes,
                          (o * dl + lo - d_lo) * hd.inner_bytes, (hi - lo) * hs.inner_bytes});
      }
    }
    // Block ids once per group; then every layer and component reuses them.
    std::vector<std::pair<uint64_t, uint64_t>> ids;
    ids.reserve(sel.logical_blocks.size());
    for (uint64_t lb : sel.logical_blocks) {
      absl::StatusOr<uint64_t> sb = LookupBlock(s, src_blocks, "prefill", lb);
      if (!sb.ok()) return sb.status();
      absl::StatusOr<uint64_t> db = LookupBlock(d, dst_blocks, "decode", lb);
      if (!db.ok()) return db.status();
      ids.emplace_back(*sb, *db);
    }
    const uint64_t per_layer = ids.size() * pieces.size() * s.components;
    gp.ranges.reserve(per_layer * s.layers.size());
    for (size_t li = 0; li < s.layers.size(); ++li) {
      const size_t layer_begin = gp.ranges.size();
      for (int c = 0; c < s.components; ++c) {
        for (const auto& [sb, db] : ids) {
          const uint64_t sa = s.BlockAddress(li, sb, c), da = d.BlockAddress(li, db, c);
          for (const ByteRange& p : pieces) {
            const ByteRange r{sa + p.src, da + p.dst, p.length};
            gp.bytes += r.length;
            if (r.length == 0) continue;
            // Merge with the previous range of this layer when contiguous on both sides.
            if (gp.ranges.size() > layer_begin) {
              ByteRange& last = gp.ranges.back();
              if (last.src + last.length == r.src && last.dst + last.length == r.dst) {
                last.length += r.length;
                continue;
              }
            }
            gp.ranges.push_back(r);
          }
        }
      }
      gp.ops_before_merge += per_layer;
      gp.layer_end.push_back(gp.ranges.size());
      gp.layers.push_back(s.layers[li]);
    }
    plan.bytes += gp.bytes;
    plan.ops_before_merge += gp.ops_before_merge;
    plan.ops_after_merge += gp.ranges.size();
    plan.groups.push_back(std::move(gp));
  }
  return plan;
}

absl::StatusOr<std::vector<uint64_t>> PageSections(const CacheGroup& g) {
  if (!g.section_row_bytes.empty()) return g.section_row_bytes;
  const uint64_t tpb = static_cast<uint64_t>(std::max(g.tokens_per_block, 1));
  const HeadSplit& h = g.heads;
  if (g.per_request_state) {
    if (g.page_bytes % tpb == 0) return std::vector<uint64_t>{g.page_bytes / tpb};
  } else if (h.total_heads > 0 && h.tp_size > 0 && g.tokens_per_entry == 1) {
    const uint64_t local = static_cast<uint64_t>(h.total_heads / h.tp_size);
    if (h.outer == tpb && local * h.inner_bytes * tpb == g.page_bytes) {
      return std::vector<uint64_t>{local * h.inner_bytes};  // NHD: a row is one token
    }
    if (h.outer == 1 && h.inner_bytes % tpb == 0 && local * h.inner_bytes == g.page_bytes) {
      // HND: per local head, its tokens' rows.
      return std::vector<uint64_t>(local, h.inner_bytes / tpb);
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "cache group '", g.name,
      "': where its pages keep each entry is unknown, so the slots a request did not fill "
      "cannot be cleared before a read grant or a write-mode push (give "
      "CacheGroup::section_row_bytes, JSON \"section_row_bytes\": the row bytes of each "
      "section of a page)"));
}

absl::StatusOr<std::vector<PageSpan>> UnfilledPageSpans(const CacheGroup& g, uint64_t logical_block,
                                                        uint64_t num_tokens) {
  const uint64_t rows = g.rows_per_block();
  uint64_t filled = 0;  // rows of this block the request wrote
  if (g.per_request_state) {
    // Token t goes to ring slot t % tokens_per_block: slots [0, num_tokens) are its own.
    filled = std::min<uint64_t>(num_tokens, rows);
  } else {
    // Only complete entries are written (a compressed entry once its tokens are all there).
    const uint64_t entries = num_tokens / static_cast<uint64_t>(g.tokens_per_entry);
    const uint64_t first = logical_block * rows;
    filled = entries <= first ? 0 : std::min<uint64_t>(entries - first, rows);
  }
  std::vector<PageSpan> out;
  if (filled == rows) return out;
  if (filled == 0) {
    out.push_back({0, g.page_bytes});
    return out;
  }
  absl::StatusOr<std::vector<uint64_t>> sections = PageSections(g);
  if (!sections.ok()) return sections.status();
  uint64_t row_bytes = 0;
  for (uint64_t row : *sections) {
    if (row == 0 || row > g.page_bytes - row_bytes)
      return GroupError(g, "page sections overflow its page");
    row_bytes += row;
  }
  if (row_bytes == 0 || rows > g.page_bytes / row_bytes) {
    return GroupError(g, "page sections do not fit its page (Layout::Validate says why)");
  }
  uint64_t at = 0;
  for (uint64_t row : *sections) {
    out.push_back({at + filled * row, (rows - filled) * row});  // the section's tail
    at += rows * row;
  }
  // The padding after the last section continues its tail.
  out.back().length += g.page_bytes - at;
  return out;
}

}  // namespace kvwire
