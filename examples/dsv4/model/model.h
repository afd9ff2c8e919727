// The DeepSeek-V4 reference model on the CPU. Deterministic: the same inputs give bit-identical
// logits whatever the thread count (work is split over independent outputs, never inside a
// reduction), so prefill + transfer + decode in two processes reproduces `generate` exactly.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_MODEL_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/kv_cache.h"

namespace dsv4 {

// Writes deterministic weights for `config` (from config.seed) as safetensors.
absl::Status GenerateWeights(const Config& config, const std::string& path);

class Model {
 public:
  // Loads weights through the safetensors reader; a file that does not match the config is
  // a clear error naming the tensor. threads = 0: hardware concurrency.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const Config& config,
                                                     const std::string& weights_path,
                                                     int threads = 0);
  ~Model();
  const Config& config() const;

  // Runs `tokens` at positions [pos, pos + tokens.size()) of one request whose KV for
  // [0, pos) is already in `blocks` (which must cover pos + tokens.size() tokens). Writes
  // the new tokens' KV (every group) into the cache and returns the logits of the last
  // token. `on_layer_done(layer)` runs once a layer's KV for these tokens is final (write
  // mode streams it from there).
  absl::StatusOr<std::vector<float>> Forward(
      KvCache& cache, const kvwire::BlockTable& blocks, std::span<const int32_t> tokens,
      uint64_t pos, const std::function<void(int layer)>& on_layer_done = nullptr);

  class Impl;

 private:
  explicit Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Greedy when temperature <= 0; else samples with a generator keyed by (seed, step), so a
// decode instance continuing at step k draws what a single process would.
int32_t SampleToken(std::span<const float> logits, float temperature, uint64_t seed, uint64_t step);

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_MODEL_H_
