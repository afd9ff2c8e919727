// DeepSeek-V4 model configuration (JSON). `tiny` runs in CI; `small` is the demo's.
// Widths, layers and experts shrink; the cache structure does not: 512-dim KV (448 NoPE + 64
// RoPE) in 584-byte fp8 records, the 128-token window, compress ratios 0 / 4 / 128, and the
// indexer (128-dim keys, 132-byte entries).
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_CONFIG_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "kvwire/layout.h"

namespace dsv4 {

struct Config {
  std::string name;
  int vocab_size = 0;  // byte tokenizer: 256 bytes + special tokens (see tokenizer.h)
  int dim = 0;
  int num_layers = 0;
  std::vector<int> compress_ratios;  // per layer: 0, 4 or 128
  int window = 128;
  int num_heads = 0;
  int head_dim = 512;  // shared KV width
  int rope_dim = 64;
  int max_seq_len = 0;
  uint64_t seed = 0;  // weights are generated from it
  // The remaining fields (q/o ranks, indexer, MoE, hyper-connections, RoPE) are the
  // model's own; see config.cc.
  int q_lora_rank = 0;
  int o_lora_rank = 0;
  int o_groups = 1;  // grouped output projection: num_heads / o_groups heads per group
  int index_n_heads = 0;
  int index_head_dim = 128;  // indexer keys: 128 fp8 + fp32 scale = 132-byte entries
  int index_topk = 0;
  int num_experts = 0;
  int experts_per_token = 0;
  int moe_inter_dim = 0;
  int num_shared_experts = 1;
  int num_hash_layers = 0;  // the first layers route by token id (table tid2eid)
  float routed_scaling_factor = 1.0f;
  float swiglu_limit = 10.0f;
  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f;
  float norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  float compress_rope_theta = 160000.0f;  // layers with compressed history
  float init_gain = 1.0f;                 // scale of the generated weights

  int nope_dim() const { return head_dim - rope_dim; }
  int ratio(int layer) const { return compress_ratios[layer]; }

  static absl::StatusOr<Config> FromJson(const std::string& json);
  static absl::StatusOr<Config> FromFile(const std::string& path);

  // The cache groups of this model, as the connector sees them (no backing yet).
  kvwire::Layout CacheLayout() const;
};

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_CONFIG_H_
