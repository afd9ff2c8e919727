// Tensor list and deterministic weight generation.
#include "examples/dsv4/model/weights.h"

#include <cmath>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"

#include "examples/dsv4/model/fp8.h"
#include "examples/dsv4/model/model.h"
#include "examples/dsv4/model/safetensors.h"

namespace dsv4 {
namespace {

// SplitMix64: a tiny, well-mixed generator whose output is the same everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float Symmetric() { return static_cast<float>((Next() >> 40) * 0x1p-23 - 1.0); }

 private:
  uint64_t state_;
};

uint64_t NameHash(const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

}  // namespace

int64_t WeightSpec::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

std::vector<WeightSpec> WeightSpecs(const Config& c) {
  std::vector<WeightSpec> w;
  const int64_t dim = c.dim, hc = c.hc_mult, mix = (2 + hc) * hc;
  auto linear = [&](std::string name, int64_t out, int64_t in) {
    w.push_back({std::move(name), {out, in}, "F32", Init::kLinear, 0.0f});
  };
  auto ones = [&](std::string name, int64_t n) {
    w.push_back({std::move(name), {n}, "F32", Init::kOnes, 0.0f});
  };
  auto uniform = [&](std::string name, std::vector<int64_t> shape, float range) {
    w.push_back({std::move(name), std::move(shape), "F32", Init::kUniform, range});
  };
  w.push_back({"embed", {c.vocab_size, dim}, "F32", Init::kEmbed, 0.0f});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    for (const char* hcname : {"hc_attn", "hc_ffn"}) {
      linear(absl::StrCat(p, hcname, "_fn"), mix, hc * dim);
      uniform(absl::StrCat(p, hcname, "_base"), {mix}, 0.5f);
      w.push_back({absl::StrCat(p, hcname, "_scale"), {3}, "F32", Init::kConstant, 0.5f});
    }
    ones(p + "attn_norm", dim);
    ones(p + "ffn_norm", dim);
    const std::string a = p + "attn.";
    linear(a + "wq_a", c.q_lora_rank, dim);
    ones(a + "q_norm", c.q_lora_rank);
    linear(a + "wq_b", int64_t{c.num_heads} * c.head_dim, c.q_lora_rank);
    linear(a + "wkv", c.head_dim, dim);
    ones(a + "kv_norm", c.head_dim);
    uniform(a + "sink", {c.num_heads}, 1.0f);
    linear(a + "wo_a", int64_t{c.o_groups} * c.o_lora_rank,
           int64_t{c.num_heads / c.o_groups} * c.head_dim);
    linear(a + "wo_b", dim, int64_t{c.o_groups} * c.o_lora_rank);
    const int ratio = c.ratio(l);
    if (ratio > 0) {
      const int64_t width = (ratio == 4 ? 2 : 1) * int64_t{c.head_dim};
      linear(a + "compressor.wkv", width, dim);
      linear(a + "compressor.wgate", width, dim);
      uniform(a + "compressor.ape", {ratio, width}, 0.5f);
      ones(a + "compressor.norm", c.head_dim);
    }
    if (ratio == 4) {
      linear(a + "indexer.wq_b", int64_t{c.index_n_heads} * c.index_head_dim, c.q_lora_rank);
      linear(a + "indexer.weights_proj", c.index_n_heads, dim);
      linear(a + "indexer.compressor.wkv", 2 * int64_t{c.index_head_dim}, dim);
      linear(a + "indexer.compressor.wgate", 2 * int64_t{c.index_head_dim}, dim);
      uniform(a + "indexer.compressor.ape", {4, 2 * int64_t{c.index_head_dim}}, 0.5f);
      ones(a + "indexer.compressor.norm", c.index_head_dim);
    }
    const std::string f = p + "ffn.";
    linear(f + "gate.weight", c.num_experts, dim);
    if (l < c.num_hash_layers) {
      w.push_back(
          {f + "gate.tid2eid", {c.vocab_size, c.experts_per_token}, "I32", Init::kHashTable, 0.0f});
    } else {
      uniform(f + "gate.bias", {c.num_experts}, 0.1f);
    }
    for (int e = 0; e < c.num_experts; ++e) {
      const std::string x = absl::StrCat(f, "experts.", e, ".");
      linear(x + "w1", c.moe_inter_dim, dim);
      linear(x + "w2", dim, c.moe_inter_dim);
      linear(x + "w3", c.moe_inter_dim, dim);
    }
    if (c.num_shared_experts > 0) {
      const int64_t inter = int64_t{c.moe_inter_dim} * c.num_shared_experts;
      linear(f + "shared_experts.w1", inter, dim);
      linear(f + "shared_experts.w2", dim, inter);
      linear(f + "shared_experts.w3", inter, dim);
    }
  }
  linear("hc_head_fn", hc, hc * dim);
  uniform("hc_head_base", {hc}, 0.5f);
  w.push_back({"hc_head_scale", {1}, "F32", Init::kConstant, 0.5f});
  ones("norm", dim);
  linear("head", c.vocab_size, dim);
  return w;
}

GeneratedTensor GenerateTensor(const Config& c, const WeightSpec& spec) {
  Rng rng(c.seed ^ NameHash(spec.name));
  GeneratedTensor t;
  const int64_t n = spec.numel();
  if (spec.init == Init::kHashTable) {
    const int64_t rows = spec.shape[0], k = spec.shape[1];
    t.ints.resize(n);
    std::vector<int32_t> experts(c.num_experts);
    for (int64_t r = 0; r < rows; ++r) {
      std::iota(experts.begin(), experts.end(), 0);
      for (int64_t i = 0; i < k; ++i) {  // partial Fisher-Yates: k distinct experts
        const int64_t j = i + static_cast<int64_t>(rng.Next() % (experts.size() - i));
        std::swap(experts[i], experts[j]);
        t.ints[r * k + i] = experts[i];
      }
    }
    return t;
  }
  t.floats.resize(n);
  float range = spec.range;
  if (spec.init == Init::kLinear) {
    range = c.init_gain * std::sqrt(3.0f / static_cast<float>(spec.shape.back()));
  } else if (spec.init == Init::kEmbed) {
    range = std::sqrt(3.0f);
  }
  for (int64_t i = 0; i < n; ++i) {
    switch (spec.init) {
      case Init::kOnes:
        t.floats[i] = 1.0f;
        break;
      case Init::kConstant:
        t.floats[i] = spec.range;
        break;
      default:
        t.floats[i] = range * rng.Symmetric();
    }
  }
  if (spec.name == "head") {
    // Random weights have no language; damping the rows of control bytes, non-ASCII bytes
    // and EOS keeps demo output printable and long enough to compare (greedy text still
    // depends on the prompt).
    // A gain of 3 gives logits a spread of a few units (a softmax that prefers some bytes).
    const int64_t dim = spec.shape[1];
    for (int64_t r = 0; r < spec.shape[0]; ++r) {
      const float gain = (r >= 32 && r < 127) || r == '\n' ? 3.0f : 0.75f;
      for (int64_t d = 0; d < dim; ++d) t.floats[r * dim + d] *= gain;
    }
  }
  return t;
}

absl::Status GenerateWeights(const Config& config, const std::string& path) {
  const std::vector<WeightSpec> specs = WeightSpecs(config);
  std::vector<GeneratedTensor> data;
  data.reserve(specs.size());
  std::vector<TensorToWrite> out;
  for (const WeightSpec& s : specs) {
    data.push_back(GenerateTensor(config, s));
    const GeneratedTensor& g = data.back();
    std::span<const uint8_t> bytes =
        s.dtype == "I32"
            ? std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(g.ints.data()),
                                       g.ints.size() * 4)
            : std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(g.floats.data()),
                                       g.floats.size() * 4);
    out.push_back({s.name, s.dtype, s.shape, bytes});
  }
  return WriteSafetensors(path, out,
                          {{"format", "pt"},
                           {"model", config.name},
                           {"seed", absl::StrCat(config.seed)},
                           {"generator", "kvwire dsv4 GenerateWeights"}});
}

}  // namespace dsv4
