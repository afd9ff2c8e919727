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

#include "examples/dsv4/model/model_impl.h"
#include "examples/dsv4/model/safetensors.h"
#include "examples/dsv4/model/weights.h"

namespace dsv4 {

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
