// A vLLM-like KV cache for the connector tests: layouts by name (presets or random ones from
// a seed), shareable backing memory (or GPU memory), a block pool per group with fragmented
// allocation, and a deterministic content pattern so decode can check every byte prefill
// wrote.
#ifndef KVWIRE_TESTS_CONNECTOR_KV_SIM_H_
#define KVWIRE_TESTS_CONNECTOR_KV_SIM_H_

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "kvwire/connector.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"
#include "src/gpu/runtime.h"

namespace kvwire::testing {

inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t HashStr(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// "random:<seed>" gives a random layout of 1-4 groups over 1-6 layers; "mha-tp:<size>:<rank>"
// (or "mha-hnd-tp:...", heads outside tokens in a page) a small MHA layout of one
// tensor-parallel rank; "<preset>@tp:<size>:<rank>" a preset whose (replicated) groups name
// that tensor-parallel place; else a preset name.
inline absl::StatusOr<Layout> MakeLayout(const std::string& spec) {
  if (const size_t at = spec.find("@tp:"); at != std::string::npos) {
    absl::StatusOr<Layout> l = PresetLayout(spec.substr(0, at));
    if (!l.ok()) return l.status();
    const std::string rest = spec.substr(at + 4);
    const size_t colon = rest.find(':');
    int size = 0, rank = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(rest.substr(0, colon), &size) ||
        !absl::SimpleAtoi(rest.substr(colon + 1), &rank)) {
      return absl::InvalidArgumentError(absl::StrCat("bad layout spec ", spec));
    }
    for (CacheGroup& g : l->groups) {
      g.heads.tp_size = size;
      g.heads.tp_rank = rank;
    }
    return l;
  }
  for (const char* prefix : {"mha-tp:", "mha-hnd-tp:"}) {
    if (spec.rfind(prefix, 0) != 0) continue;
    const std::string rest = spec.substr(std::string(prefix).size());
    const size_t colon = rest.find(':');
    MhaOptions o;
    o.layers = 4;
    o.kv_heads = 8;
    o.head_dim = 64;
    o.heads_outer = spec.rfind("mha-hnd", 0) == 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(rest.substr(0, colon), &o.tp_size) ||
        !absl::SimpleAtoi(rest.substr(colon + 1), &o.tp_rank)) {
      return absl::InvalidArgumentError(absl::StrCat("bad layout spec ", spec));
    }
    Layout l = MhaLayout(o);
    if (absl::Status s = l.Validate(); !s.ok()) return s;
    return l;
  }
  if (spec.rfind("random:", 0) != 0) return PresetLayout(spec);
  uint64_t seed = 0;
  if (!absl::SimpleAtoi(spec.substr(7), &seed)) {
    return absl::InvalidArgumentError(absl::StrCat("bad layout spec ", spec));
  }
  std::mt19937_64 rng(seed);
  Layout l;
  l.model = spec;
  const int layers = 1 + rng() % 6;
  const int groups = 1 + rng() % 4;
  for (int i = 0; i < groups; ++i) {
    CacheGroup g;
    g.name = absl::StrCat("g", i);
    for (int layer = 0; layer < layers; ++layer) {
      if (layer == 0 || rng() % 3 != 0) g.layers.push_back(layer);
    }
    const int kind = rng() % 4;  // 0 full, 1 window, 2 compressed, 3 state
    static const int kTpb[] = {16, 32, 64, 256};
    g.tokens_per_block = kTpb[rng() % 4];
    g.page_bytes = 64 * (1 + rng() % 64) + (rng() % 2) * 8;
    if (kind == 1) g.window_tokens = 64 * (1 + rng() % 3);
    if (kind == 2) g.tokens_per_entry = g.tokens_per_block >= 64 ? 4 : 16;
    if (kind == 3) {
      g.per_request_state = true;
      g.tokens_per_block = 8;
      g.tokens_per_entry = 4;
      g.window_tokens = 8;
      g.page_bytes = 8 * 64 * (1 + rng() % 4);
    }
    if (kind == 0 && rng() % 2 == 0) g.components = 2;
    // Token-major rows (padding after them), so that read grants can clear the rows a
    // request did not fill; a page holds at least one byte per row.
    g.page_bytes = std::max<uint64_t>(g.page_bytes, g.rows_per_block());
    g.section_row_bytes = {g.page_bytes / g.rows_per_block()};
    l.groups.push_back(std::move(g));
  }
  return l;
}

// One side's KV cache: memory, layout with backing, block pools.
//
// With a GPU runtime the KV memory is device memory of `device` (registered as kGpu): the
// layout's addresses are device addresses, and Fill / Verify work on a host shadow that the
// runtime's copies push to (Fill) and pull from (Verify) the device, so the same code runs on
// the emulated GPU and on a real one.
class KvCache {
 public:
  // Writes host bytes to device memory synchronously on the calling thread (the emulated GPU's
  // WriteDevice). Given, Fill pushes with it instead of a stream copy.
  using DeviceWriter = std::function<absl::Status(void* device, const void* host, size_t bytes)>;

  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const std::string& spec,
                                                         uint64_t num_blocks, uint64_t state_blocks,
                                                         uint64_t seed, gpu::Runtime* gpu = nullptr,
                                                         int device = 0,
                                                         DeviceWriter writer = nullptr) {
    absl::StatusOr<Layout> layout = MakeLayout(spec);
    if (!layout.ok()) return layout.status();
    auto c = std::make_unique<KvCache>();
    c->layout_ = std::move(*layout);
    const uint64_t bytes = AssignBacking(&c->layout_, 0, num_blocks, state_blocks) + 4096;
    absl::StatusOr<ShareableBuffer> buf = ShareableBuffer::Create(bytes, "kv-sim");
    if (!buf.ok()) return buf.status();
    c->memory_ = std::move(*buf);
    c->base_ = reinterpret_cast<uint64_t>(c->memory_.data());
    if (gpu != nullptr) {
      absl::StatusOr<gpu::DeviceBuffer> d = gpu::DeviceBuffer::Allocate(*gpu, device, bytes);
      if (!d.ok()) return d.status();
      absl::StatusOr<gpu::Stream> st = gpu::Stream::Create(*gpu, device);
      if (!st.ok()) return st.status();
      c->device_ = std::move(*d);
      c->stream_ = std::move(*st);
      c->base_ = reinterpret_cast<uint64_t>(c->device_.data());
      c->writer_ = std::move(writer);
    }
    AssignBacking(&c->layout_, c->base_, num_blocks, state_blocks);
    std::memset(c->memory_.data(), 0xab, c->memory_.size());
    if (absl::Status s = c->Push(); !s.ok()) return s;
    c->rng_.seed(seed);
    for (const CacheGroup& g : c->layout_.groups) {
      std::vector<int64_t>& free = c->free_[g.name];
      for (uint64_t b = 0; b < g.num_blocks; ++b) free.push_back(static_cast<int64_t>(b));
      std::shuffle(free.begin(), free.end(), c->rng_);  // fragmented from the start
    }
    return c;
  }

  // Fragmentation like a long-running pool: free blocks come in runs of 1..max_run
  // consecutive ids, the runs in random order; allocation then takes them in that order.
  void FragmentInRuns(uint64_t max_run) {
    for (const CacheGroup& g : layout_.groups) {
      std::vector<std::vector<int64_t>> runs;
      for (uint64_t b = 0; b < g.num_blocks;) {
        const uint64_t n = std::min<uint64_t>(1 + rng_() % max_run, g.num_blocks - b);
        runs.emplace_back();
        for (uint64_t i = 0; i < n; ++i) runs.back().push_back(static_cast<int64_t>(b + i));
        b += n;
      }
      std::shuffle(runs.begin(), runs.end(), rng_);
      std::vector<int64_t>& free = free_[g.name];
      free.clear();
      for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
        free.insert(free.end(), it->rbegin(), it->rend());  // popped from the back
      }
    }
    sequential_ = true;
  }

  const Layout& layout() const { return layout_; }
  std::vector<KvMemory> memory() const {
    if (on_gpu()) {
      return {{device_.data(), device_.size(), MemoryKind::kGpu, device_.device()}};
    }
    return {{memory_.data(), memory_.size()}};
  }
  bool on_gpu() const { return device_.data() != nullptr; }
  // Where the bytes at layout address `addr` are on the host: the memory itself, or the
  // shadow of device memory (current after Fill / Pull).
  uint8_t* Host(uint64_t addr) const {
    return reinterpret_cast<uint8_t*>(memory_.data()) + (addr - base_);
  }
  // GPU memory: device -> shadow (what Verify reads), shadow -> device.
  absl::Status Pull() {
    return on_gpu() ? stream_.Copy(memory_.data(), device_.data(), device_.size())
                    : absl::OkStatus();
  }
  absl::Status Push() {
    return on_gpu() ? stream_.Copy(device_.data(), memory_.data(), device_.size())
                    : absl::OkStatus();
  }

  // Allocates what a request of `tokens` tokens needs: every logical block for full-history
  // groups, only in-window blocks for window groups (-1 elsewhere), one block for states.
  absl::StatusOr<BlockTable> Allocate(const std::string& req, uint64_t tokens) {
    BlockTable t;
    for (const CacheGroup& g : layout_.groups) {
      std::vector<int64_t>& free = free_[g.name];
      std::vector<int64_t> ids;
      const uint64_t n =
          g.per_request_state ? 1 : (tokens + g.tokens_per_block - 1) / g.tokens_per_block;
      uint64_t first = 0;
      if (g.window_tokens > 0 && !g.per_request_state && tokens > uint64_t(g.window_tokens)) {
        first = (tokens - g.window_tokens) / g.tokens_per_block;
      }
      for (uint64_t i = 0; i < n; ++i) {
        if (i < first) {
          ids.push_back(-1);
          continue;
        }
        if (free.empty()) {
          t[g.name] = ids;
          Free(t);
          return absl::ResourceExhaustedError(
              absl::StrCat("request ", req, ": group ", g.name, " out of blocks"));
        }
        const size_t pick = sequential_ ? free.size() - 1 : rng_() % free.size();
        ids.push_back(free[pick]);
        free[pick] = free.back();
        free.pop_back();
      }
      t[g.name] = ids;
    }
    live_[req] = t;
    return t;
  }

  void Free(const BlockTable& t) {
    for (const auto& [g, ids] : t) {
      for (int64_t id : ids) {
        if (id >= 0) free_[g].push_back(id);
      }
    }
  }
  bool Release(const std::string& req) {
    auto it = live_.find(req);
    if (it == live_.end()) return false;
    Free(it->second);
    live_.erase(it);
    return true;
  }
  const std::map<std::string, BlockTable>& live() const { return live_; }

  // Every block is free or owned by exactly one live request.
  std::string CheckAccounting() const {
    for (const CacheGroup& g : layout_.groups) {
      std::vector<int> owners(g.num_blocks, 0);
      for (int64_t id : free_.at(g.name)) ++owners[id];
      for (const auto& [req, t] : live_) {
        for (int64_t id : t.at(g.name)) {
          if (id >= 0) ++owners[id];
        }
      }
      for (uint64_t b = 0; b < g.num_blocks; ++b) {
        if (owners[b] != 1) {
          return absl::StrCat("group ", g.name, " block ", b, " has ", owners[b], " owners");
        }
      }
    }
    return "";
  }
  size_t FreeBlocks() const {
    size_t n = 0;
    for (const auto& [g, f] : free_) n += f.size();
    return n;
  }

  uint64_t PageKey(const std::string& req, const CacheGroup& g, size_t layer, uint64_t logical,
                   int component) const {
    return Mix(HashStr(req) ^ Mix(HashStr(g.name) + layer * 1000003 + logical * 7919 +
                                  static_cast<uint64_t>(component)));
  }

  // Prefill: writes the pattern into every allocated page of the request.
  //
  // Checked by ThreadSanitizer like any other access: the engine orders a fill after the
  // serving of a previous reader's ops (the connector waits for them before it hands a
  // released block back, Engine::WaitForServedOps) and before the serving of the next
  // reader's (the connector publishes held blocks, Engine::PublishMemory).
  void Fill(const std::string& req, const BlockTable& t) {
    FillPages(req, t);
    // The whole shadow: only prefill fills, and nothing but Fill writes its memory.
    absl::Status s =
        writer_ && on_gpu() ? writer_(device_.data(), memory_.data(), device_.size()) : Push();
    if (!s.ok()) gpu_error_ = std::string(s.message());
  }

  void FillPages(const std::string& req, const BlockTable& t) {
    for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
      const CacheGroup& g = layout_.groups[gi];
      const std::vector<int64_t>& ids = t.at(g.name);
      for (size_t l = 0; l < g.layers.size(); ++l) {
        for (int c = 0; c < g.components; ++c) {
          for (size_t lb = 0; lb < ids.size(); ++lb) {
            if (ids[lb] < 0) continue;
            uint8_t* p = Host(g.BlockAddress(l, ids[lb], c));
            const uint64_t key = PageKey(req, g, l, lb, c);
            for (uint64_t i = 0; i < g.page_bytes; ++i) p[i] = Expected(key, GlobalOffset(g, i));
          }
        }
      }
    }
  }

  // The logical blocks of a history group (not a per-request state) that a request of
  // `tokens`, `cached` of them already at the destination, must move, token by token: a
  // token moves when the destination lacks it, it is within the sliding window (if any), and
  // its compression entry is complete; its block is token / tokens_per_block. "" when
  // `sel` (SelectBlocks) is exactly that set.
  static std::string CheckSelection(const CacheGroup& g, const BlockSelection& sel, uint64_t tokens,
                                    uint64_t cached) {
    if (g.per_request_state) return "";
    const uint64_t ratio = static_cast<uint64_t>(g.tokens_per_entry);
    const uint64_t window = static_cast<uint64_t>(g.window_tokens);
    std::vector<uint64_t> want;
    for (uint64_t p = cached; p < tokens; ++p) {
      if (window > 0 && p + window < tokens) continue;  // before the window
      if ((p / ratio + 1) * ratio > tokens) continue;   // its entry is not complete
      if (want.empty() || want.back() != p / g.tokens_per_block) {
        want.push_back(p / g.tokens_per_block);
      }
    }
    if (want == sel.logical_blocks) return "";
    return absl::StrCat("group ", g.name, ": SelectBlocks chose blocks [",
                        absl::StrJoin(sel.logical_blocks, ","), "], the token-by-token rule [",
                        absl::StrJoin(want, ","), "] (", tokens, " tokens, ", cached, " cached)");
  }

  // Decode: checks every byte that must have moved for the request (of model layer
  // `only_layer`, or of all layers). Returns "" when all match.
  std::string Verify(const std::string& req, const BlockTable& t, uint64_t tokens, uint64_t cached,
                     int only_layer = -1) {
    if (!gpu_error_.empty()) return "gpu: " + gpu_error_;
    if (absl::Status s = Pull(); !s.ok()) return absl::StrCat("gpu: ", s.message());
    for (const CacheGroup& g : layout_.groups) {
      const BlockSelection sel = SelectBlocks(g, tokens, cached);
      // The blocks checked are the ones a token-by-token reading of the layout's rules needs,
      // not only the ones the code under test selected: one it left out is a failure here.
      if (std::string missed = CheckSelection(g, sel, tokens, cached); !missed.empty()) {
        return absl::StrCat("request ", req, ": ", missed);
      }
      const std::vector<int64_t>& ids = t.at(g.name);
      for (size_t l = 0; l < g.layers.size(); ++l) {
        if (only_layer >= 0 && g.layers[l] != only_layer) continue;
        for (int c = 0; c < g.components; ++c) {
          for (uint64_t lb : sel.logical_blocks) {
            const uint8_t* p = Host(g.BlockAddress(l, ids[lb], c));
            const uint64_t key = PageKey(req, g, l, lb, c);
            std::vector<std::pair<uint64_t, uint64_t>> spans;
            if (g.per_request_state) {
              const uint64_t slot = g.page_bytes / g.tokens_per_block;
              for (uint64_t k = 0; k < sel.slot_count; ++k) {
                const uint64_t s = (sel.slot_begin + k) % g.tokens_per_block;
                spans.push_back({s * slot, (s + 1) * slot});
              }
            } else {
              // The rows the request filled (with read grants the prefill clears the others
              // before the reader may read them; ReadScrubTest checks that part).
              absl::StatusOr<std::vector<PageSpan>> unfilled = UnfilledPageSpans(g, lb, tokens);
              if (!unfilled.ok()) return std::string(unfilled.status().message());
              uint64_t at = 0;
              for (const PageSpan& u : *unfilled) {
                if (u.offset > at) spans.push_back({at, u.offset});
                at = u.offset + u.length;
              }
              if (at < g.page_bytes) spans.push_back({at, g.page_bytes});
            }
            for (const auto& [b, e] : spans) {
              for (uint64_t i = b; i < e; ++i) {
                const uint8_t want = Expected(key, GlobalOffset(g, i));
                if (p[i] != want) {
                  return absl::StrCat("request ", req, " group ", g.name, " layer ", g.layers[l],
                                      " logical block ", lb, " component ", c, " byte ", i,
                                      ": got ", p[i], " want ", want);
                }
              }
            }
          }
        }
      }
    }
    return "";
  }

 private:
  // Offset `i` of a page of this rank in the page of all heads (tensor parallelism splits a
  // page [outer][heads][inner] by heads), so that every rank agrees on each head's bytes.
  static uint64_t GlobalOffset(const CacheGroup& g, uint64_t i) {
    const HeadSplit& h = g.heads;
    if (h.total_heads == 0 || h.tp_size == 1) return i;
    const uint64_t local = h.total_heads / h.tp_size;
    const uint64_t row = local * h.inner_bytes;
    const uint64_t o = i / row, head = (i % row) / h.inner_bytes, b = i % h.inner_bytes;
    return (o * h.total_heads + h.tp_rank * local + head) * h.inner_bytes + b;
  }

  static uint8_t Expected(uint64_t key, uint64_t i) {
    return static_cast<uint8_t>(Mix(key + i / 8) >> (8 * (i % 8)));
  }

  Layout layout_;
  ShareableBuffer memory_;  // the KV memory, or the host shadow of device_
  uint64_t base_ = 0;       // address of the KV memory (memory_ or device_)
  gpu::DeviceBuffer device_;
  gpu::Stream stream_;
  DeviceWriter writer_;
  std::string gpu_error_;
  std::mt19937_64 rng_;
  bool sequential_ = false;
  std::map<std::string, std::vector<int64_t>> free_;
  std::map<std::string, BlockTable> live_;
};

// "" when every request event the connector's handlers met was taken by a row of the
// transition table and every request ended where its row did; else what the stats count.
inline std::string MachineErrors(const Connector& c) {
  const nlohmann::json j = nlohmann::json::parse(c.StatsJson(), nullptr, false);
  if (!j.is_object() || !j.contains("machine")) return "no request machine counts in the stats";
  const nlohmann::json& m = j["machine"];
  if (m.value("refused", uint64_t{1}) == 0 && m.value("diverged", uint64_t{1}) == 0) return "";
  return absl::StrCat("request machine: refused=", m.value("refused", uint64_t{0}),
                      " diverged=", m.value("diverged", uint64_t{0}));
}

// Decode's kv_transfer_params for a write-mode request to the prefill at `address`.
inline KvTransferParams WriteParams(const std::string& address, const std::string& tid,
                                    uint64_t tokens) {
  KvTransferParams p;
  const size_t colon = address.rfind(':');
  p.host = address.substr(0, colon);
  p.port = std::stoi(address.substr(colon + 1));
  p.transfer_id = tid;
  p.mode = KvMode::kWrite;
  p.num_tokens = tokens;
  p.do_remote_prefill = true;
  return p;
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_CONNECTOR_KV_SIM_H_
