// Config from JSON: every field is named in its error, and the cache structure the connector
// and the fp8 record depend on (512-dim KV, 64 RoPE dims, 128-token window, 128-dim indexer
// keys, ratios 0/4/128) is checked rather than trusted.
#include "examples/dsv4/model/config.h"

#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "examples/dsv4/model/tokenizer.h"
#include "kvwire/deepseek.h"

namespace dsv4 {
namespace {

using nlohmann::json;

absl::Status FieldError(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config field '", field, "': ", what));
}

// Reads an integer field into `out`; `required` fields must be present.
absl::Status ReadInt(const json& j, const char* field, bool required, int64_t lo, int64_t hi,
                     int* out) {
  auto it = j.find(field);
  if (it == j.end()) {
    return required ? FieldError(field, "missing") : absl::OkStatus();
  }
  if (!it->is_number_integer()) return FieldError(field, "must be an integer");
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) {
    return FieldError(field, absl::StrCat(v, " is outside [", lo, ", ", hi, "]"));
  }
  *out = static_cast<int>(v);
  return absl::OkStatus();
}

absl::Status ReadFloat(const json& j, const char* field, double lo, double hi, float* out) {
  auto it = j.find(field);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_number()) return FieldError(field, "must be a number");
  const double v = it->get<double>();
  if (!(v >= lo && v <= hi)) {
    return FieldError(field, absl::StrCat(v, " is outside [", lo, ", ", hi, "]"));
  }
  *out = static_cast<float>(v);
  return absl::OkStatus();
}

absl::Status MustEqual(const char* field, int value, int expected, const char* why) {
  if (value == expected) return absl::OkStatus();
  return FieldError(field, absl::StrCat(value, " must be ", expected, " (", why, ")"));
}

}  // namespace

absl::StatusOr<Config> Config::FromJson(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("config: not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("config: top level must be an object");
  Config c;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) {
    return FieldError("name", "missing or not a non-empty string");
  }
  c.name = name->get<std::string>();
  constexpr int64_t kBig = 1 << 24;
  struct IntField {
    const char* name;
    bool required;
    int64_t lo, hi;
    int* out;
  };
  const IntField ints[] = {
      {"vocab_size", true, kByteVocab, kBig, &c.vocab_size},
      {"dim", true, 1, kBig, &c.dim},
      {"num_layers", true, 1, 1024, &c.num_layers},
      {"window", false, 1, kBig, &c.window},
      {"num_heads", true, 1, 1024, &c.num_heads},
      {"head_dim", false, 1, kBig, &c.head_dim},
      {"rope_dim", false, 2, kBig, &c.rope_dim},
      {"max_seq_len", true, 1, kBig, &c.max_seq_len},
      {"q_lora_rank", true, 1, kBig, &c.q_lora_rank},
      {"o_lora_rank", true, 1, kBig, &c.o_lora_rank},
      {"o_groups", false, 1, 1024, &c.o_groups},
      {"index_n_heads", true, 1, 1024, &c.index_n_heads},
      {"index_head_dim", false, 1, kBig, &c.index_head_dim},
      {"index_topk", true, 1, kBig, &c.index_topk},
      {"num_experts", true, 1, 4096, &c.num_experts},
      {"experts_per_token", true, 1, 4096, &c.experts_per_token},
      {"moe_inter_dim", true, 1, kBig, &c.moe_inter_dim},
      {"num_shared_experts", false, 0, 16, &c.num_shared_experts},
      {"num_hash_layers", false, 0, 1024, &c.num_hash_layers},
      {"hc_mult", false, 1, 16, &c.hc_mult},
      {"hc_sinkhorn_iters", false, 1, 1000, &c.hc_sinkhorn_iters},
  };
  for (const IntField& f : ints) {
    if (absl::Status s = ReadInt(j, f.name, f.required, f.lo, f.hi, f.out); !s.ok()) return s;
  }
  struct FloatField {
    const char* name;
    double lo, hi;
    float* out;
  };
  const FloatField floats[] = {
      {"routed_scaling_factor", 0.0, 1e6, &c.routed_scaling_factor},
      {"swiglu_limit", 0.0, 1e6, &c.swiglu_limit},
      {"hc_eps", 0.0, 1.0, &c.hc_eps},
      {"norm_eps", 0.0, 1.0, &c.norm_eps},
      {"rope_theta", 1.0, 1e12, &c.rope_theta},
      {"compress_rope_theta", 1.0, 1e12, &c.compress_rope_theta},
      {"init_gain", 0.0, 1e3, &c.init_gain},
  };
  for (const FloatField& f : floats) {
    if (absl::Status s = ReadFloat(j, f.name, f.lo, f.hi, f.out); !s.ok()) return s;
  }
  auto seed = j.find("seed");
  if (seed == j.end()) return FieldError("seed", "missing");
  if (!seed->is_number_unsigned() && !(seed->is_number_integer() && seed->get<int64_t>() >= 0)) {
    return FieldError("seed", "must be a non-negative integer");
  }
  c.seed = seed->get<uint64_t>();
  auto ratios = j.find("compress_ratios");
  if (ratios == j.end() || !ratios->is_array()) {
    return FieldError("compress_ratios", "missing or not an array");
  }
  for (const json& r : *ratios) {
    if (!r.is_number_integer()) return FieldError("compress_ratios", "entries must be integers");
    const int64_t v = r.get<int64_t>();
    if (v != 0 && v != 4 && v != 128) {
      return FieldError("compress_ratios", absl::StrCat("ratio ", v, " is not 0, 4 or 128"));
    }
    c.compress_ratios.push_back(static_cast<int>(v));
  }
  // The fixed cache structure: the 584-byte record, the window the connector moves, and
  // the 132-byte indexer entries are what kvwire's DeepSeek-V4 layout describes.
  if (absl::Status s = MustEqual("head_dim", c.head_dim, 512, "584-byte KV record"); !s.ok()) {
    return s;
  }
  if (absl::Status s = MustEqual("rope_dim", c.rope_dim, 64, "584-byte KV record"); !s.ok()) {
    return s;
  }
  if (absl::Status s = MustEqual("window", c.window, 128, "swa_kv window of the layout"); !s.ok()) {
    return s;
  }
  if (absl::Status s = MustEqual("index_head_dim", c.index_head_dim, 128, "132-byte entries");
      !s.ok()) {
    return s;
  }
  if (static_cast<int>(c.compress_ratios.size()) != c.num_layers) {
    return FieldError("compress_ratios", absl::StrCat(c.compress_ratios.size(),
                                                      " entries for num_layers ", c.num_layers));
  }
  if (c.num_heads % c.o_groups != 0) {
    return FieldError("o_groups",
                      absl::StrCat(c.o_groups, " does not divide num_heads ", c.num_heads));
  }
  if (c.experts_per_token > c.num_experts) {
    return FieldError("experts_per_token",
                      absl::StrCat(c.experts_per_token, " > num_experts ", c.num_experts));
  }
  if (c.num_hash_layers > c.num_layers) {
    return FieldError("num_hash_layers",
                      absl::StrCat(c.num_hash_layers, " > num_layers ", c.num_layers));
  }
  return c;
}

absl::StatusOr<Config> Config::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("config: cannot open ", path));
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<Config> c = FromJson(text.str());
  if (!c.ok()) {
    return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  }
  return c;
}

kvwire::Layout Config::CacheLayout() const {
  return kvwire::DeepSeekV4Layout(name, compress_ratios);
}

}  // namespace dsv4
