// KV-cache layouts: the cache groups of a model instance, where their pages live, and the
// mapping of a request's tokens to the byte ranges that must move between prefill and decode.
//
// A layout is a list of cache groups. A group is one kind of paged KV tensor (e.g. DeepSeek-V4
// "c4a main KV") with its own block size and page size, present on a set of layers. Every
// layer of a group has its own base address; block b of layer l, component c (K or V for
// MHA, else 0) starts at
//     layer_base[l] + b * block_stride + c * component_stride
// and is page_bytes long.
//
// Three kinds of groups:
//  - full history (window_tokens == 0): every block covering the prompt moves;
//  - sliding window (window_tokens > 0): only blocks intersecting the last window tokens;
//  - per-request state (per_request_state): one block per request holds a ring of
//    tokens_per_block token slots (slot = token % tokens_per_block); only the slots of the
//    unfinished compression window move.
#ifndef KVWIRE_LAYOUT_H_
#define KVWIRE_LAYOUT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvwire {

// Tensor-parallel head split of a page: a page is [outer][local_heads][inner_bytes] where
// local_heads = total_heads / tp_size. Groups whose KV is identical on every rank (MLA,
// DeepSeek-V4) leave total_heads at 0.
struct HeadSplit {
  int total_heads = 0;  // 0: the page is replicated on every rank
  int tp_size = 1;
  int tp_rank = 0;
  uint64_t outer = 1;        // e.g. tokens per block for [block_size, heads, head_dim]
  uint64_t inner_bytes = 0;  // bytes of one head in one outer row
};

struct CacheGroup {
  std::string name;
  std::vector<int> layers;   // model layer indices this group is present on
  int tokens_per_block = 0;  // tokens (not entries) one block covers
  uint64_t page_bytes = 0;   // bytes of one block of one layer (one component)
  int tokens_per_entry = 1;  // compression ratio: 1 = one entry per token
  int window_tokens = 0;     // sliding window; 0 = full history; ring size for state groups
  bool per_request_state = false;
  int components = 1;  // 2 for K and V in separate pages (MHA), else 1
  HeadSplit heads;

  // Backing memory (addresses in this process). One base per entry of `layers`.
  std::vector<uint64_t> layer_base;
  uint64_t num_blocks = 0;
  uint64_t block_stride = 0;      // 0: page_bytes * (block-major components) or page_bytes
  uint64_t component_stride = 0;  // distance between K and V pages of one block
  // How AssignBacking lays out two components: true [blocks][2][page], false [2][blocks][page].
  bool block_major = true;

  // Where a page keeps each of its rows (an entry; a token slot of a state group), so that
  // the bytes a request did not fill can be told apart (a read grant covers whole pages: the
  // connector clears the unfilled rows of a request's blocks before granting them). The page
  // is sections laid one after another from offset 0; section i holds rows_per_block() rows
  // of section_row_bytes[i] bytes each (row r at r * section_row_bytes[i] in the section);
  // bytes after the last section are padding. E.g. DeepSeek-V4 KV {576, 8} (all data rows,
  // then all scale rows), its indexer K {128, 4}, MLA {656} (token-major).
  // Empty: derived where the group says it (PageSections): head-split groups from `heads`,
  // state groups token-major; unknown for any other group.
  std::vector<uint64_t> section_row_bytes;

  // Entries one block holds (tokens_per_block / tokens_per_entry).
  uint64_t entries_per_block() const { return tokens_per_block / tokens_per_entry; }
  // Rows of each page section: token slots (tokens_per_block) for a state group, else entries.
  uint64_t rows_per_block() const {
    return per_request_state ? static_cast<uint64_t>(tokens_per_block) : entries_per_block();
  }
  bool full_history() const { return window_tokens == 0 && !per_request_state; }
  uint64_t BlockAddress(size_t layer_index, uint64_t block, int component) const;
};

struct Layout {
  std::string model;  // informational, e.g. "deepseek-v4-pro"
  std::vector<CacheGroup> groups;

  const CacheGroup* FindGroup(const std::string& name) const;
  // Checks internal consistency (sizes, strides, layer bases); errors name the group.
  absl::Status Validate() const;
};

// Layouts as JSON (addresses included). FromJson validates.
std::string LayoutToJson(const Layout& layout);
absl::StatusOr<Layout> LayoutFromJson(const std::string& json);

// --- presets ----------------------------------------------------------------------------
// Presets describe the groups with their real byte sizes; AssignBacking lays the groups out
// one after another from `base` with `num_blocks` blocks each (per group, per layer) and
// returns the bytes used. Callers allocate that much and call it again with the address.

// The DeepSeek presets (DeepSeek-V4 Pro/Flash, V3/V3.2, the V4 record size) are in
// kvwire/deepseek.h.

struct MhaOptions {
  int layers = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int dtype_bytes = 2;
  int tokens_per_block = 16;
  // true: [blocks, 2, block_size, heads, head_dim]; false: [2, blocks, block_size, ...].
  bool block_major = false;
  // true: heads before tokens inside a page ([heads, block_size, head_dim], "HND").
  bool heads_outer = false;
  int tp_size = 1;
  int tp_rank = 0;
};
Layout MhaLayout(const MhaOptions& options);

// Looks a preset up by name: deepseek-v4-pro, deepseek-v4-flash, deepseek-v3, deepseek-v3.2,
// mha (defaults).
absl::StatusOr<Layout> PresetLayout(const std::string& name);

// State groups get `state_blocks` blocks (one per concurrent request) when it is non-zero.
uint64_t AssignBacking(Layout* layout, uint64_t base, uint64_t num_blocks,
                       uint64_t state_blocks = 0);

// --- block mapping ----------------------------------------------------------------------

// Block ids per group name, indexed by logical block (token / tokens_per_block). Entries
// for blocks that never move (e.g. outside the window) may be -1. State groups: one id.
using BlockTable = std::map<std::string, std::vector<int64_t>>;

// Logical blocks of a group that move for a request of `num_tokens` tokens of which the
// destination already holds the first `num_cached_tokens` (prefix hit).
struct BlockSelection {
  std::vector<uint64_t> logical_blocks;
  // State groups: the token slots [slot_begin, slot_begin + slot_count) modulo the ring.
  uint64_t slot_begin = 0;
  uint64_t slot_count = 0;
};
BlockSelection SelectBlocks(const CacheGroup& group, uint64_t num_tokens,
                            uint64_t num_cached_tokens = 0);

struct ByteRange {
  uint64_t src = 0;  // address on the source (prefill) side
  uint64_t dst = 0;  // address on the destination (decode) side
  uint64_t length = 0;
};

struct GroupPlan {
  std::string group;
  uint64_t blocks = 0;            // logical blocks moved (per layer)
  uint64_t bytes = 0;             // all layers
  uint64_t ops_before_merge = 0;  // one per contiguous piece of a page
  std::vector<ByteRange> ranges;  // after merging, ordered by layer
  std::vector<size_t> layer_end;  // ranges[layer_end[i-1]..layer_end[i]) belong to layer i
  std::vector<int> layers;        // model layer of each layer_end entry
};

struct TransferPlan {
  std::vector<GroupPlan> groups;
  uint64_t bytes = 0;
  uint64_t ops_before_merge = 0;
  uint64_t ops_after_merge = 0;
  // Ranges of one model layer across all groups (for layer-wise streaming).
  std::vector<ByteRange> LayerRanges(int layer) const;
  std::vector<int> Layers() const;  // model layers present, ascending
};

// Checks that `src` (prefill) and `dst` (decode) can exchange KV: the same groups with the
// same layers, block size, entry size, window and state kind, and pages that map onto each
// other (identical pages, or head splits of the same heads). Errors name the group and what
// differs.
absl::Status CheckCompatible(const Layout& src, const Layout& dst);

// The byte ranges that move a request from src to dst. Block tables index logical blocks;
// a needed block missing from a table (or -1, or past num_blocks) is an error naming the
// group, the side and the block. Adjacent ranges contiguous on both sides are merged.
absl::StatusOr<TransferPlan> PlanTransfer(const Layout& src, const BlockTable& src_blocks,
                                          const Layout& dst, const BlockTable& dst_blocks,
                                          uint64_t num_tokens, uint64_t num_cached_tokens = 0);

// Merges ranges contiguous on both sides (in order). Returns the merged list.
std::vector<ByteRange> MergeRanges(const std::vector<ByteRange>& ranges);

// --- rows a request did not fill --------------------------------------------------------

// A byte range inside one page.
struct PageSpan {
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const PageSpan&) const = default;
};

// The row bytes of each section of a page of `group` (see CacheGroup::section_row_bytes):
// the explicit ones, else derived: head-split groups (heads.total_heads > 0) with tokens as
// rows (outer == tokens_per_block, "NHD"): {local_heads * inner_bytes}; with heads outside
// tokens (outer == 1, "HND"): one section of inner_bytes / tokens_per_block per local head;
// state groups: {page_bytes / tokens_per_block}. FailedPrecondition naming the group when
// the placement is neither given nor derivable (e.g. a replicated history group without it:
// DeepSeek-V4's pages are not token-major, so none is assumed).
absl::StatusOr<std::vector<uint64_t>> PageSections(const CacheGroup& group);

// The byte ranges of one page of `logical_block` of `group` (every layer and component
// alike) that a request of `num_tokens` tokens did not fill: the rows past its last
// complete entry (compressed groups: num_tokens / tokens_per_entry entries; state groups:
// the ring slots of tokens it never had, none once num_tokens >= tokens_per_block), in
// every section, plus the page's padding. Empty for a full block; the whole page for a
// block past the request's entries. Errors as PageSections, only when the block is not
// full.
absl::StatusOr<std::vector<PageSpan>> UnfilledPageSpans(const CacheGroup& group,
                                                        uint64_t logical_block,
                                                        uint64_t num_tokens);

}  // namespace kvwire

#endif  // KVWIRE_LAYOUT_H_
