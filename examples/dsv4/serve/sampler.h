// Token sampling with vLLM's parameters (sampling_params.h), keyed only by (seed, step): the
// same logits, prompt, earlier tokens, parameters and seed give the same token in every process,
// so a decode server that samples a request's tokens equals the aggregated server's.
//
// Order, as vLLM v1's sampler: EOS masked while fewer than min_tokens tokens exist; repetition,
// frequency and presence penalties; greedy (argmax) below kGreedyTemperature; otherwise
// temperature, min_p, top_k, top_p, then one draw of SplitMix64(seed, step) over what is left.
// With none of the filters or penalties the draw is the reference engine's SampleToken (the
// `generate` command's), token for token.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_SAMPLER_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_SAMPLER_H_

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "examples/dsv4/serve/sampling_params.h"

namespace dsv4::serve {

// The logprobs of one position: the sampled token's and the top ones (highest first).
struct TokenLogprobs {
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

struct Sampled {
  int32_t token = 0;
  TokenLogprobs logprobs;  // filled when the params ask for logprobs
};

class Sampler {
 public:
  // `seed`: the request's (SamplingParams::seed, or a random one when it has none) plus the
  // choice's index. `prompt`: for the repetition penalty.
  Sampler(const SamplingParams& params, uint64_t seed, std::vector<int32_t> prompt,
          int32_t eos_token);

  // Token `output.size()` of the generation, after `output`.
  Sampled Next(std::span<const float> logits, const std::vector<int32_t>& output) const;

  uint64_t seed() const { return seed_; }

 private:
  SamplingParams params_;
  uint64_t seed_;
  std::vector<int32_t> prompt_;
  int32_t eos_;
};

// log_softmax of `logits` (double accumulation).
std::vector<float> LogSoftmax(std::span<const float> logits);

// A seed for a request that gave none (from the system's random source).
uint64_t RandomSeed();

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_SAMPLER_H_
