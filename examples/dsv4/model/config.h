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

  static absl::StatusOr<Config> FromJson(const std::string& json);
  static absl::StatusOr<Config> FromFile(const std::string& path);

  // The cache groups of this model, as the connector sees them (no backing yet).
  kvwire::Layout CacheLayout() const;
};

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_CONFIG_H_
