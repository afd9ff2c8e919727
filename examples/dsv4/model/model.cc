// The DeepSeek-V4 reference model on the CPU.
//
// Cache contract: attention reads every key back from the paged fp8 cache (never from
// private arrays), and the compressors keep their pending tokens only in the state rings
// (slot = token % ring). A decode instance that received the blocks and ring slots the
// connector moves (kvwire::SelectBlocks) therefore computes exactly what this instance
// would: SWA keys older than the window and ring slots before the unfinished compression
// window are never read.
//
// A cache in executor memory (KvCache::executor(), e.g. a GPU) takes the same steps with the
// cache work moved there: records are written by the encode kernel, attention reads them in
// the kernels of gpu/ (bit-identical to the CPU path, see gpu/attention_math.h), the
// compressor rings and indexer keys are copied to the host and back around the CPU code.
#include "examples/dsv4/model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "examples/dsv4/model/fp8.h"
#include "examples/dsv4/model/gpu/kv_executor.h"
#include "examples/dsv4/model/gpu/kv_ops.h"
#include "examples/dsv4/model/ops.h"
#include "examples/dsv4/model/safetensors.h"
#include "examples/dsv4/model/thread_pool.h"
#include "examples/dsv4/model/weights.h"
#include "src/util/mutex.h"

namespace dsv4 {
namespace {

struct Expert {
  const float* w1 = nullptr;  // [inter, dim]
  const float* w2 = nullptr;  // [dim, inter]
  const float* w3 = nullptr;  // [inter, dim]
  int inter = 0;
};

struct HcParams {
  const float* fn = nullptr;
  const float* base = nullptr;
  const float* scale = nullptr;
};

struct Compressor {
  const float* wkv = nullptr;
  const float* wgate = nullptr;
  const float* ape = nullptr;
  const float* norm = nullptr;
};

struct Layer {
  int ratio = 0;
  float theta = 0;
  HcParams hc_attn, hc_ffn;
  const float *attn_norm, *ffn_norm;
  const float *wq_a, *q_norm, *wq_b, *wkv, *kv_norm, *sink, *wo_a, *wo_b;
  Compressor comp, index_comp;
  const float *index_wq_b = nullptr, *index_weights = nullptr;
  const float *gate = nullptr, *gate_bias = nullptr;
  const int32_t* tid2eid = nullptr;
  std::vector<Expert> experts;
  Expert shared;
};

// One state ring of a request: `ring` slots of `floats` floats ([kv | score]).
struct Ring {
  float* base = nullptr;
  int ring = 0;
  int floats = 0;
  float* Slot(int64_t token) const { return base + (token % ring) * floats; }
};

}  // namespace

class Model::Impl {
 public:
  Impl(const Config& c, int threads) : config(c), pool(threads) {}

  absl::Status LoadWeights(const std::string& path);
  absl::StatusOr<std::vector<float>> Forward(KvCache& cache, const kvwire::BlockTable& blocks,
                                             std::span<const int32_t> tokens, uint64_t pos,
                                             const std::function<void(int)>& on_layer_done);

  Config config;
  ThreadPool pool;

 private:
  // y[t][o] = w[o] . x[t] for t < T.
  void Linear(const float* w, int out, int in, const float* x, int T, float* y) {
    pool.ParallelFor(out, [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o) {
        const float* row = w + o * in;
        for (int t = 0; t < T; ++t) y[int64_t{t} * out + o] = Dot(row, x + int64_t{t} * in, in);
      }
    });
  }
  void HcPre(const HcParams& p, const float* X, int T, float* Y, std::vector<HcWeights>& mix);
  void HcPost(const std::vector<HcWeights>& mix, const float* A, int T, float* X);
  absl::Status Attention(int l, KvCache& cache, const kvwire::BlockTable& blocks, const float* Yn,
                         std::span<const int32_t> tokens, int64_t pos, float* out,
                         const std::function<void(int)>& on_layer_done);
  void Moe(int l, const float* Yn, std::span<const int32_t> tokens, float* out);
  void RunExpert(const Expert& e, const float* X, const std::vector<int>& rows, float* out);

  const float* F(const std::string& name) const { return floats_.at(name).data(); }

  std::map<std::string, std::vector<float>> floats_;
  std::map<std::string, std::vector<int32_t>> ints_;
  std::vector<Layer> layers_;
};

absl::Status Model::Impl::LoadWeights(const std::string& path) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  const std::vector<WeightSpec> specs = WeightSpecs(config);
  std::map<std::string, bool> expected;
  for (const WeightSpec& s : specs) {
    expected[s.name] = true;
    absl::StatusOr<TensorView> t = file->Get(s.name);
    if (!t.ok()) {
      return absl::NotFoundError(
          absl::StrCat(path, ": tensor '", s.name, "' is missing (config '", config.name, "')"));
    }
    if (t->dtype != s.dtype || t->shape != s.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", s.name, "' is ", t->dtype, " [",
                       absl::StrJoin(t->shape, ","), "] but config '", config.name, "' needs ",
                       s.dtype, " [", absl::StrJoin(s.shape, ","), "]"));
    }
    if (s.dtype == "I32") {
      std::vector<int32_t>& v = ints_[s.name];
      v.resize(s.numel());
      std::memcpy(v.data(), t->bytes.data(), t->bytes.size());
      for (int32_t e : v) {
        if (e < 0 || e >= config.num_experts) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", s.name,
                                                         "' holds expert id ", e, " outside [0, ",
                                                         config.num_experts, ")"));
        }
      }
    } else {
      std::vector<float>& v = floats_[s.name];
      v.resize(s.numel());
      std::memcpy(v.data(), t->bytes.data(), t->bytes.size());
    }
  }
  for (const auto& [name, view] : file->tensors()) {
    if (!expected.count(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unexpected tensor '", name, "' for config '", config.name, "'"));
    }
  }
  const Config& c = config;
  layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    Layer& L = layers_[l];
    const std::string p = absl::StrCat("layers.", l, ".");
    L.ratio = c.ratio(l);
    L.theta = L.ratio > 0 ? c.compress_rope_theta : c.rope_theta;
    L.hc_attn = {F(p + "hc_attn_fn"), F(p + "hc_attn_base"), F(p + "hc_attn_scale")};
    L.hc_ffn = {F(p + "hc_ffn_fn"), F(p + "hc_ffn_base"), F(p + "hc_ffn_scale")};
    L.attn_norm = F(p + "attn_norm");
    L.ffn_norm = F(p + "ffn_norm");
    const std::string a = p + "attn.";
    L.wq_a = F(a + "wq_a");
    L.q_norm = F(a + "q_norm");
    L.wq_b = F(a + "wq_b");
    L.wkv = F(a + "wkv");
    L.kv_norm = F(a + "kv_norm");
    L.sink = F(a + "sink");
    L.wo_a = F(a + "wo_a");
    L.wo_b = F(a + "wo_b");
    if (L.ratio > 0) {
      L.comp = {F(a + "compressor.wkv"), F(a + "compressor.wgate"), F(a + "compressor.ape"),
                F(a + "compressor.norm")};
    }
    if (L.ratio == 4) {
      L.index_wq_b = F(a + "indexer.wq_b");
      L.index_weights = F(a + "indexer.weights_proj");
      L.index_comp = {F(a + "indexer.compressor.wkv"), F(a + "indexer.compressor.wgate"),
                      F(a + "indexer.compressor.ape"), F(a + "indexer.compressor.norm")};
    }
    const std::string f = p + "ffn.";
    L.gate = F(f + "gate.weight");
    if (l < c.num_hash_layers) {
      L.tid2eid = ints_.at(f + "gate.tid2eid").data();
    } else {
      L.gate_bias = F(f + "gate.bias");
    }
    for (int e = 0; e < c.num_experts; ++e) {
      const std::string x = absl::StrCat(f, "experts.", e, ".");
      L.experts.push_back({F(x + "w1"), F(x + "w2"), F(x + "w3"), c.moe_inter_dim});
    }
    if (c.num_shared_experts > 0) {
      L.shared = {F(f + "shared_experts.w1"), F(f + "shared_experts.w2"),
                  F(f + "shared_experts.w3"), c.moe_inter_dim * c.num_shared_experts};
    }
  }
  return absl::OkStatus();
}

void Model::Impl::HcPre(const HcParams& p, const float* X, int T, float* Y,
                        std::vector<HcWeights>& mix) {
  const int hc = config.hc_mult, dim = config.dim, nmix = (2 + hc) * hc;
  mix.resize(T);
  pool.ParallelFor(T, [&](int64_t b, int64_t e) {
    std::vector<float> m(nmix);
    for (int64_t t = b; t < e; ++t) {
      const float* flat = X + t * hc * dim;
      double ss = 0.0;
      for (int i = 0; i < hc * dim; ++i) ss += static_cast<double>(flat[i]) * flat[i];
      const float rs = static_cast<float>(1.0 / std::sqrt(ss / (hc * dim) + config.norm_eps));
      for (int i = 0; i < nmix; ++i) m[i] = Dot(p.fn + int64_t{i} * hc * dim, flat, hc * dim) * rs;
      mix[t] =
          HcSplitSinkhorn(m.data(), p.scale, p.base, hc, config.hc_sinkhorn_iters, config.hc_eps);
      float* y = Y + t * dim;
      std::fill(y, y + dim, 0.0f);
      for (int s = 0; s < hc; ++s) {
        const float w = mix[t].pre[s];
        for (int d = 0; d < dim; ++d) y[d] += w * flat[s * dim + d];
      }
    }
  });
}

void Model::Impl::HcPost(const std::vector<HcWeights>& mix, const float* A, int T, float* X) {
  const int hc = config.hc_mult, dim = config.dim;
  pool.ParallelFor(T, [&](int64_t b, int64_t e) {
    std::vector<float> old(hc * dim);
    for (int64_t t = b; t < e; ++t) {
      float* x = X + t * hc * dim;
      std::copy(x, x + hc * dim, old.begin());
      for (int s = 0; s < hc; ++s) {
        for (int d = 0; d < dim; ++d) {
          float v = mix[t].post[s] * A[t * dim + d];
          for (int r = 0; r < hc; ++r) v += mix[t].comb[r * hc + s] * old[r * dim + d];
          x[s * dim + d] = v;
        }
      }
    }
  });
}

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

void Model::Impl::RunExpert(const Expert& ex, const float* X, const std::vector<int>& rows,
                            float* out) {
  const int dim = config.dim, n = static_cast<int>(rows.size());
  std::vector<float> hidden(int64_t{n} * ex.inter);
  pool.ParallelFor(ex.inter, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int i = 0; i < n; ++i) {
        const float* x = X + int64_t{rows[i]} * dim;
        hidden[int64_t{i} * ex.inter + r] =
            SwiGlu(Dot(ex.w1 + r * dim, x, dim), Dot(ex.w3 + r * dim, x, dim), config.swiglu_limit);
      }
    }
  });
  pool.ParallelFor(dim, [&](int64_t b, int64_t e) {
    for (int64_t d = b; d < e; ++d) {
      for (int i = 0; i < n; ++i) {
        out[int64_t{i} * dim + d] =
            Dot(ex.w2 + d * ex.inter, hidden.data() + int64_t{i} * ex.inter, ex.inter);
      }
    }
  });
}

void Model::Impl::Moe(int l, const float* Yn, std::span<const int32_t> tokens, float* out) {
  const Config& c = config;
  const Layer& L = layers_[l];
  const int T = static_cast<int>(tokens.size()), E = c.num_experts, K = c.experts_per_token;
  const int dim = c.dim;
  std::vector<float> logits(int64_t{T} * E);
  Linear(L.gate, E, dim, Yn, T, logits.data());
  std::vector<int> chosen(int64_t{T} * K);
  std::vector<float> weights(int64_t{T} * K);
  for (int t = 0; t < T; ++t) {
    const int32_t* hash = L.tid2eid != nullptr ? L.tid2eid + int64_t{tokens[t]} * K : nullptr;
    RouteExperts(logits.data() + int64_t{t} * E, L.gate_bias, hash, E, K, c.routed_scaling_factor,
                 chosen.data() + int64_t{t} * K, weights.data() + int64_t{t} * K);
  }
  // Per (token, slot) outputs, then a fixed-order sum per token.
  std::vector<float> slot_out(int64_t{T} * K * dim);
  for (int e = 0; e < E; ++e) {
    std::vector<int> rows, slots;
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        if (chosen[int64_t{t} * K + k] == e) {
          rows.push_back(t);
          slots.push_back(t * K + k);
        }
      }
    }
    if (rows.empty()) continue;
    std::vector<float> y(rows.size() * dim);
    RunExpert(L.experts[e], Yn, rows, y.data());
    for (size_t i = 0; i < rows.size(); ++i) {
      std::copy(y.begin() + i * dim, y.begin() + (i + 1) * dim,
                slot_out.begin() + int64_t{slots[i]} * dim);
    }
  }
  if (c.num_shared_experts > 0) {
    std::vector<int> all(T);
    for (int t = 0; t < T; ++t) all[t] = t;
    RunExpert(L.shared, Yn, all, out);
  } else {
    std::fill(out, out + int64_t{T} * dim, 0.0f);
  }
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const float w = weights[int64_t{t} * K + k];
      const float* y = slot_out.data() + (int64_t{t} * K + k) * dim;
      for (int d = 0; d < dim; ++d) out[int64_t{t} * dim + d] += w * y[d];
    }
  }
}

absl::StatusOr<std::vector<float>> Model::Impl::Forward(
    KvCache& cache, const kvwire::BlockTable& blocks, std::span<const int32_t> tokens, uint64_t pos,
    const std::function<void(int)>& on_layer_done) {
  const Config& c = config;
  if (tokens.empty()) return absl::InvalidArgumentError("Forward: no tokens");
  const uint64_t end = pos + tokens.size();
  if (end > static_cast<uint64_t>(c.max_seq_len)) {
    return absl::OutOfRangeError(
        absl::StrCat("Forward: ", end, " tokens exceed max_seq_len ", c.max_seq_len));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("Forward: token ", t, " outside the vocabulary of ", c.vocab_size));
    }
  }
  // Every page Forward touches must exist: check the block table once, up front.
  for (const kvwire::CacheGroup& g : cache.layout().groups) {
    auto it = blocks.find(g.name);
    const uint64_t need =
        g.per_request_state ? 1 : (end + g.tokens_per_block - 1) / g.tokens_per_block;
    if (it == blocks.end() || it->second.size() < need) {
      return absl::InvalidArgumentError(
          absl::StrCat("Forward: block table of group '", g.name, "' has ",
                       it == blocks.end() ? 0 : it->second.size(), " blocks, ", need,
                       " needed for ", end, " tokens"));
    }
    for (uint64_t b = 0; b < need; ++b) {
      const int64_t id = it->second[b];
      if (id < 0 || static_cast<uint64_t>(id) >= g.num_blocks) {
        // SWA blocks before the window may be released (-1); they are never read.
        if (g.name == "swa_kv" && g.window_tokens > 0 &&
            (b + 1) * g.tokens_per_block + g.window_tokens <= pos + 1) {
          continue;
        }
        return absl::InvalidArgumentError(
            absl::StrCat("Forward: group '", g.name, "' logical block ", b, " has bad id ", id));
      }
    }
  }
  const int T = static_cast<int>(tokens.size()), dim = c.dim, hc = c.hc_mult;
  std::vector<float> X(int64_t{T} * hc * dim), Y(int64_t{T} * dim), A(int64_t{T} * dim);
  const float* embed = F("embed");
  for (int t = 0; t < T; ++t) {
    for (int s = 0; s < hc; ++s) {
      std::copy(embed + int64_t{tokens[t]} * dim, embed + int64_t{tokens[t] + 1} * dim,
                X.begin() + (int64_t{t} * hc + s) * dim);
    }
  }
  std::vector<HcWeights> mix;
  for (int l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[l];
    HcPre(L.hc_attn, X.data(), T, Y.data(), mix);
    for (int t = 0; t < T; ++t) {
      RmsNorm(Y.data() + int64_t{t} * dim, L.attn_norm, dim, c.norm_eps,
              Y.data() + int64_t{t} * dim);
    }
    if (absl::Status s = Attention(l, cache, blocks, Y.data(), tokens, static_cast<int64_t>(pos),
                                   A.data(), on_layer_done);
        !s.ok()) {
      return s;
    }
    HcPost(mix, A.data(), T, X.data());
    HcPre(L.hc_ffn, X.data(), T, Y.data(), mix);
    for (int t = 0; t < T; ++t) {
      RmsNorm(Y.data() + int64_t{t} * dim, L.ffn_norm, dim, c.norm_eps,
              Y.data() + int64_t{t} * dim);
    }
    Moe(l, Y.data(), tokens, A.data());
    HcPost(mix, A.data(), T, X.data());
  }
  // Head: the last token's streams reduced with sigmoid weights, normalised, projected.
  const float* flat = X.data() + int64_t{T - 1} * hc * dim;
  double ss = 0.0;
  for (int i = 0; i < hc * dim; ++i) ss += static_cast<double>(flat[i]) * flat[i];
  const float rs = static_cast<float>(1.0 / std::sqrt(ss / (hc * dim) + c.norm_eps));
  std::vector<float> y(dim, 0.0f);
  const float* fn = F("hc_head_fn");
  const float* base = F("hc_head_base");
  const float hscale = F("hc_head_scale")[0];
  for (int s = 0; s < hc; ++s) {
    const float m = Dot(fn + int64_t{s} * hc * dim, flat, hc * dim) * rs;
    const float w = 1.0f / (1.0f + std::exp(-(m * hscale + base[s]))) + c.hc_eps;
    for (int d = 0; d < dim; ++d) y[d] += w * flat[s * dim + d];
  }
  RmsNorm(y.data(), F("norm"), dim, c.norm_eps, y.data());
  std::vector<float> logits(c.vocab_size);
  Linear(F("head"), c.vocab_size, dim, y.data(), 1, logits.data());
  return logits;
}

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const Config& config,
                                                   const std::string& weights_path, int threads) {
  auto impl = std::make_unique<Impl>(config, threads);
  if (absl::Status s = impl->LoadWeights(weights_path); !s.ok()) return s;
  return std::unique_ptr<Model>(new Model(std::move(impl)));
}

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::~Model() = default;
const Config& Model::config() const { return impl_->config; }

absl::StatusOr<std::vector<float>> Model::Forward(
    KvCache& cache, const kvwire::BlockTable& blocks, std::span<const int32_t> tokens, uint64_t pos,
    const std::function<void(int layer)>& on_layer_done) {
  return impl_->Forward(cache, blocks, tokens, pos, on_layer_done);
}

int32_t SampleToken(std::span<const float> logits, float temperature, uint64_t seed,
                    uint64_t step) {
  if (logits.empty()) return 0;
  if (temperature <= 0.0f) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const float m = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - m) / temperature);
    sum += p[i];
  }
  // SplitMix64 of (seed, step): the draw of step k is the same in every process.
  uint64_t z = seed + (step + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const double u = static_cast<double>(z >> 11) * 0x1p-53 * sum;
  double acc = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    acc += p[i];
    if (u < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(p.size() - 1);
}

}  // namespace dsv4
