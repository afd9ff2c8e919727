// Single-process generation: the reference every disaggregated run is checked against.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_GENERATE_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_GENERATE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "examples/dsv4/model/kv_cache.h"
#include "examples/dsv4/model/model.h"

namespace dsv4 {

struct GenerateOptions {
  int max_tokens = 32;       // generated tokens at most (EOS included)
  float temperature = 0.0f;  // <= 0: greedy
  uint64_t seed = 0;         // sampling: token k is SampleToken(logits, temperature, seed, k)
  bool stop_at_eos = true;
};

struct GenerateResult {
  std::vector<int32_t> prompt_tokens;  // BOS + bytes
  std::vector<int32_t> tokens;         // generated; token 0 comes from the prompt's logits
  std::string text;                    // Decode(tokens)
  double prefill_seconds = 0;          // the prompt's Forward (first token's logits)
  double decode_seconds = 0;           // every later Forward
  // CPU seconds of the whole process over the same spans (on a shared machine the wall
  // times say more about the neighbours than about the model).
  double prefill_cpu_seconds = 0;
  double decode_cpu_seconds = 0;
};

// Disaggregated runs reproduce this exactly when prefill samples token 0 from the prompt's
// logits with SampleToken(logits, temperature, seed, 0) and decode samples token k (k >= 1)
// with step k after Forward of token k-1 at position prompt_size + k - 1.
//
// Encodes `prompt`, allocates its blocks in `cache`, runs the prompt through one Forward,
// samples, then decodes one token per Forward until max_tokens or EOS; frees the blocks.
absl::StatusOr<GenerateResult> Generate(Model& model, KvCache& cache, std::string_view prompt,
                                        const GenerateOptions& options);
absl::StatusOr<GenerateResult> GenerateFromTokens(Model& model, KvCache& cache,
                                                  std::vector<int32_t> prompt_tokens,
                                                  const GenerateOptions& options);

// Writes GenerateWeights(config, path) unless `path` already exists.
absl::Status EnsureWeights(const Config& config, const std::string& path);

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_GENERATE_H_
