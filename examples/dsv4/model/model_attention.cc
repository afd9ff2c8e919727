// The DeepSeek-V4 reference model: one layer's attention (Model::Impl::Attention). See
// model.cc for the cache contract it keeps: every key is read back from the paged fp8 cache,
// and the compressors keep their pending tokens only in the state rings.
#include <algorithm>
#include <cmath>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "examples/dsv4/model/fp8.h"
#include "examples/dsv4/model/gpu/kv_executor.h"
#include "examples/dsv4/model/gpu/kv_ops.h"
#include "examples/dsv4/model/model_impl.h"

namespace dsv4 {

absl::Status Model::Impl::Attention(int l, KvCache& cache, const kvwire::BlockTable& blocks,
                                    const float* Yn, std::span<const int32_t> tokens, int64_t pos,
                                    float* out, const std::function<void(int)>& on_layer_done) {
  const Config& c = config;
  const Layer& L = layers_[l];
  const int T = static_cast<int>(tokens.size());
  const int H = c.num_heads, D = c.head_dim, R = c.rope_dim, dim = c.dim;
  const int64_t end = pos + T;
  auto page_of = [&](const std::string& group, int64_t logical) -> uint8_t* {
    return cache.Page(group, l, blocks.at(group)[logical]);
  };
  // Non-null: the pages are executor memory, reached only through it.
  gpu::KvExecutor* const dev = cache.executor();
  // The KV-cache write on the executor: records from `src` (host) to slots of this layer.
  auto write_records = [&](const std::string& group, const float* src,
                           std::span<const int64_t> slots) {
    const kvwire::CacheGroup* g = cache.layout().FindGroup(group);
    return gpu::EncodeRecords(*dev, cache.Page(group, l, 0), g->page_bytes,
                              static_cast<uint32_t>(g->entries_per_block()), g->num_blocks, src,
                              slots);
  };

  // Queries: low-rank path, per-head RMS normalisation, RoPE on the last 64 dims.
  std::vector<float> qlat(int64_t{T} * c.q_lora_rank), q(int64_t{T} * H * D);
  Linear(L.wq_a, c.q_lora_rank, dim, Yn, T, qlat.data());
  for (int t = 0; t < T; ++t) {
    float* x = qlat.data() + int64_t{t} * c.q_lora_rank;
    RmsNorm(x, L.q_norm, c.q_lora_rank, c.norm_eps, x);
  }
  Linear(L.wq_b, H * D, c.q_lora_rank, qlat.data(), T, q.data());
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      float* x = q.data() + (int64_t{t} * H + h) * D;
      RmsNorm(x, nullptr, D, c.norm_eps, x);
      Rope(x + D - R, R, pos + t, L.theta);
    }
  }

  // This token's own KV: normalised, RoPE'd, written as an fp8 record into swa_kv.
  std::vector<float> kv(int64_t{T} * D);
  Linear(L.wkv, D, dim, Yn, T, kv.data());
  std::vector<int64_t> swa_slots;
  for (int t = 0; t < T; ++t) {
    float* x = kv.data() + int64_t{t} * D;
    RmsNorm(x, L.kv_norm, D, c.norm_eps, x);
    Rope(x + D - R, R, pos + t, L.theta);
    const int64_t tok = pos + t;
    if (dev == nullptr) {
      EncodeKvRecord(x, page_of("swa_kv", tok / 64), 64, static_cast<int>(tok % 64));
    } else {
      swa_slots.push_back(blocks.at("swa_kv")[tok / 64] * 64 + tok % 64);
    }
  }
  if (dev != nullptr) {
    if (absl::Status s = write_records("swa_kv", kv.data(), swa_slots); !s.ok()) return s;
  }

  // Compressors: each token's [kv | score] goes into the ring; a completed window becomes
  // an entry computed from the ring alone.
  auto compress = [&](const Compressor& cp, int head_dim, int ratio, const char* state_group,
                      const std::function<void(int64_t, const float*)>& emit) -> absl::Status {
    const int coff = ratio == 4 ? 2 : 1;
    const int W = coff * head_dim;
    std::vector<float> ck(int64_t{T} * W), cs(int64_t{T} * W);
    Linear(cp.wkv, W, dim, Yn, T, ck.data());
    Linear(cp.wgate, W, dim, Yn, T, cs.data());
    const kvwire::CacheGroup* g = cache.layout().FindGroup(state_group);
    uint8_t* const state_page = page_of(state_group, 0);
    // Executor memory: the ring is updated in a host copy of its page, then copied back.
    std::vector<float> ring_copy;
    if (dev != nullptr) {
      ring_copy.resize(g->page_bytes / sizeof(float));
      if (absl::Status s = dev->Download(ring_copy.data(), state_page, g->page_bytes); !s.ok()) {
        return s;
      }
    }
    Ring ring{dev != nullptr ? ring_copy.data() : reinterpret_cast<float*>(state_page),
              g->tokens_per_block, 2 * W};
    std::vector<float> entry(head_dim);
    std::vector<const float*> kvp, scp;
    for (int t = 0; t < T; ++t) {
      const int64_t tok = pos + t;
      float* slot = ring.Slot(tok);
      const float* ape = cp.ape + (tok % ratio) * W;
      for (int i = 0; i < W; ++i) {
        slot[i] = ck[int64_t{t} * W + i];
        slot[W + i] = cs[int64_t{t} * W + i] + ape[i];
      }
      if ((tok + 1) % ratio != 0) continue;
      const int64_t j = (tok + 1) / ratio - 1;
      kvp.clear();
      scp.clear();
      if (coff == 2 && j > 0) {  // overlap: the previous window through the first half
        for (int64_t s = (j - 1) * ratio; s < j * ratio; ++s) {
          kvp.push_back(ring.Slot(s));
          scp.push_back(ring.Slot(s) + W);
        }
      }
      const int off = coff == 2 ? head_dim : 0;
      for (int64_t s = j * ratio; s < (j + 1) * ratio; ++s) {
        kvp.push_back(ring.Slot(s) + off);
        scp.push_back(ring.Slot(s) + W + off);
      }
      CompressTokens(kvp.data(), scp.data(), static_cast<int>(kvp.size()), head_dim, entry.data());
      RmsNorm(entry.data(), cp.norm, head_dim, c.norm_eps, entry.data());
      Rope(entry.data() + head_dim - R, R, j * ratio, L.theta);
      emit(j, entry.data());
    }
    if (dev != nullptr) return dev->Upload(state_page, ring_copy.data(), g->page_bytes);
    return absl::OkStatus();
  };
  const std::string main_group = L.ratio == 4 ? "c4a_kv" : "c128a_kv";
  if (L.ratio > 0) {
    const char* state = L.ratio == 4 ? "c4a_compressor_state" : "c128a_compressor_state";
    const int per_page = 256 / L.ratio;
    std::vector<float> entries_src;  // executor: the entries, written after the compressor
    std::vector<int64_t> entry_slots;
    absl::Status s = compress(L.comp, D, L.ratio, state, [&](int64_t j, const float* e) {
      if (dev == nullptr) {
        EncodeKvRecord(e, page_of(main_group, j / per_page), per_page,
                       static_cast<int>(j % per_page));
      } else {
        entries_src.insert(entries_src.end(), e, e + D);
        entry_slots.push_back(blocks.at(main_group)[j / per_page] * per_page + j % per_page);
      }
    });
    if (s.ok() && dev != nullptr) s = write_records(main_group, entries_src.data(), entry_slots);
    if (!s.ok()) return s;
  }
  if (L.ratio == 4) {
    // Executor: each 132-byte key is encoded on the host and copied into its page (data row
    // at j % 64, fp32 scale after the 64 data rows).
    std::vector<std::pair<int64_t, std::vector<float>>> keys_src;
    absl::Status s = compress(
        L.index_comp, c.index_head_dim, 4, "c4a_indexer_compressor_state",
        [&](int64_t j, const float* e) {
          if (dev == nullptr) {
            EncodeIndexerKey(e, page_of("c4a_indexer_k", j / 64), 64, static_cast<int>(j % 64));
          } else {
            keys_src.emplace_back(j, std::vector<float>(e, e + c.index_head_dim));
          }
        });
    for (const auto& [j, e] : keys_src) {
      if (!s.ok()) break;
      uint8_t key[kIndexDim + kIndexScaleBytes];
      EncodeIndexerKey(e.data(), key, 1, 0);
      uint8_t* page = page_of("c4a_indexer_k", j / 64);
      s = dev->Upload(page + (j % 64) * kIndexDim, key, kIndexDim);
      if (s.ok()) {
        s = dev->Upload(page + 64 * kIndexDim + (j % 64) * kIndexScaleBytes, key + kIndexDim,
                        kIndexScaleBytes);
      }
    }
    if (!s.ok()) return s;
  }
  if (on_layer_done) on_layer_done(l);

  // Keys, read back from the cache: the window of the first query onwards, and every
  // complete compressed entry.
  // (Executor memory: the attention kernels read the records in place.)
  const int64_t first = std::max<int64_t>(0, pos - (c.window - 1));
  const int64_t entries = L.ratio > 0 ? end / L.ratio : 0;
  std::vector<float> swa, comp, index_keys;
  if (dev == nullptr) {
    swa.resize((end - first) * D);
    for (int64_t tok = first; tok < end; ++tok) {
      DecodeKvRecord(page_of("swa_kv", tok / 64), 64, static_cast<int>(tok % 64),
                     swa.data() + (tok - first) * D);
    }
    comp.resize(entries * D);
    for (int64_t j = 0; j < entries; ++j) {
      const int per_page = 256 / L.ratio;
      DecodeKvRecord(page_of(main_group, j / per_page), per_page, static_cast<int>(j % per_page),
                     comp.data() + j * D);
    }
  }
  std::vector<float> iq, iw;
  const int IH = c.index_n_heads, ID = c.index_head_dim;
  if (L.ratio == 4) {
    index_keys.resize(entries * ID);
    std::vector<uint8_t> index_page;  // executor: a host copy of the page being decoded
    for (int64_t j = 0; j < entries; ++j) {
      const uint8_t* page = page_of("c4a_indexer_k", j / 64);
      if (dev != nullptr) {
        if (j % 64 == 0) {
          const uint64_t bytes = cache.layout().FindGroup("c4a_indexer_k")->page_bytes;
          index_page.resize(bytes);
          if (absl::Status s = dev->Download(index_page.data(), page, bytes); !s.ok()) return s;
        }
        page = index_page.data();
      }
      DecodeIndexerKey(page, 64, static_cast<int>(j % 64), index_keys.data() + j * ID);
    }
    iq.resize(int64_t{T} * IH * ID);
    iw.resize(int64_t{T} * IH);
    Linear(L.index_wq_b, IH * ID, c.q_lora_rank, qlat.data(), T, iq.data());
    Linear(L.index_weights, IH, dim, Yn, T, iw.data());
    const float wscale = 1.0f / std::sqrt(static_cast<float>(IH) * ID);
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < IH; ++h)
        Rope(iq.data() + (int64_t{t} * IH + h) * ID + ID - R, R, pos + t, L.theta);
      for (int h = 0; h < IH; ++h) iw[int64_t{t} * IH + h] *= wscale;
    }
  }

  std::vector<const float*> ikeys;
  for (int64_t j = 0; j < static_cast<int64_t>(index_keys.size()) / ID; ++j) {
    ikeys.push_back(index_keys.data() + j * ID);
  }
  std::vector<float> o(int64_t{T} * H * D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  if (dev != nullptr) {
    // The same keys in the same order as below, as references to their records.
    const uint8_t* base = static_cast<const uint8_t*>(cache.memory()[0].ptr);
    auto ref = [&](const std::string& group, int64_t logical, int per_page, int64_t index) {
      return gpu::KeyRef{static_cast<uint64_t>(page_of(group, logical) - base),
                         static_cast<uint32_t>(per_page), static_cast<uint32_t>(index)};
    };
    std::vector<std::vector<gpu::KeyRef>> keys(T);
    pool.ParallelFor(T, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t i = pos + t;
        if (L.ratio == 128) {
          for (int64_t j = 0; j < VisibleEntries(i, 128); ++j) {
            keys[t].push_back(ref(main_group, j / 2, 2, j % 2));
          }
        } else if (L.ratio == 4) {
          for (int j : IndexerSelect(iq.data() + t * IH * ID, iw.data() + t * IH, IH, ikeys.data(),
                                     entries, ID, i, 4, c.index_topk)) {
            keys[t].push_back(ref(main_group, j / 64, 64, j % 64));
          }
        }
        for (int64_t tok = std::max<int64_t>(0, i - (c.window - 1)); tok <= i; ++tok) {
          keys[t].push_back(ref("swa_kv", tok / 64, 64, tok % 64));
        }
      }
    });
    if (absl::Status s = gpu::Attend(*dev, base, q.data(), H, keys, scale, L.sink, o.data());
        !s.ok()) {
      return s;
    }
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < H; ++h) {
        Rope(o.data() + (int64_t{t} * H + h) * D + D - R, R, pos + t, L.theta, /*inverse=*/true);
      }
    }
  } else {
    pool.ParallelFor(T, [&](int64_t b, int64_t e) {
      std::vector<const float*> keys;
      for (int64_t t = b; t < e; ++t) {
        const int64_t i = pos + t;
        keys.clear();
        if (L.ratio == 128) {
          for (int64_t j = 0; j < VisibleEntries(i, 128); ++j) keys.push_back(comp.data() + j * D);
        } else if (L.ratio == 4) {
          for (int j : IndexerSelect(iq.data() + t * IH * ID, iw.data() + t * IH, IH, ikeys.data(),
                                     entries, ID, i, 4, c.index_topk)) {
            keys.push_back(comp.data() + int64_t{j} * D);
          }
        }
        for (int64_t tok = std::max<int64_t>(0, i - (c.window - 1)); tok <= i; ++tok) {
          keys.push_back(swa.data() + (tok - first) * D);
        }
        for (int h = 0; h < H; ++h) {
          float* oh = o.data() + (t * H + h) * D;
          AttendWithSink(q.data() + (t * H + h) * D, keys.data(), static_cast<int>(keys.size()), D,
                         scale, L.sink[h], oh);
          Rope(oh + D - R, R, i, L.theta, /*inverse=*/true);
        }
      }
    });
  }

  // Grouped output projection: each group of heads through its own low-rank matrix.
  const int G = c.o_groups, OR = c.o_lora_rank, gin = H / G * D;
  std::vector<float> z(int64_t{T} * G * OR);
  pool.ParallelFor(G * OR, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t g = r / OR;
      for (int t = 0; t < T; ++t) {
        z[int64_t{t} * G * OR + r] =
            Dot(L.wo_a + r * gin, o.data() + int64_t{t} * H * D + g * gin, gin);
      }
    }
  });
  Linear(L.wo_b, dim, G * OR, z.data(), T, out);
  return absl::OkStatus();
}

}  // namespace dsv4
