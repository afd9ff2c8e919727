// The sampling parameters of an OpenAI/vLLM completion or chat request, with vLLM's semantics
// and bounds (vllm/sampling_params.py and vllm/entrypoints/openai/protocol.py):
//
//   temperature in [0, 2]: 0 is greedy (top_p, top_k and min_p then do nothing), one in
//     (0, 0.01) is raised to 0.01. Unset (or null): 1.0, as vLLM's OpenAI server when the
//     model's generation config names none (the reference engine's configs name none), so a
//     client that wants greedy output says "temperature": 0.
//   top_p in (0, 1]; top_k -1 or 0 (off) or >= 1; min_p in [0, 1]
//   presence_penalty and frequency_penalty in [-2, 2] (over the generated tokens);
//   repetition_penalty > 0 (over the prompt and the generated tokens; 1: off)
//   seed: any 64-bit signed integer; none (or -1): a random one per request (two runs differ).
//     Choice i of n samples with seed + i (vLLM's parallel sampling).
//   min_tokens >= 0 and <= max_tokens: EOS cannot be sampled and stop strings do not end the
//     output before min_tokens tokens. ignore_eos: EOS does not end the output.
//   logprobs (completions): -1 (every token) or >= 0 top tokens per position, besides the
//     sampled one; chat: logprobs (bool) and top_logprobs (-1 or >= 0, needs logprobs).
//     The values are the model's own distribution (vLLM's default raw_logprobs), before
//     temperature, penalties and filters. The server bounds the count (--max-logprobs, 20).
//   n in [1, kMaxChoices] choices (choices.h), more than one only when sampling (not greedy);
//     a router counts a request with n choices as n requests in flight;
//   echo (completions): the prompt is prepended to the text.
//
// A prefill of a disaggregated request (kv_transfer_params.do_remote_decode) computes one
// token that the client never sees: the relations that only bind the generation (min_tokens <=
// max_tokens; the proxy sets max_tokens 1 there) are not checked on it.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_SAMPLING_PARAMS_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_SAMPLING_PARAMS_H_

#include <cstdint>
#include <optional>

#include <nlohmann/json.hpp>

#include "src/util/json_fields.h"

namespace dsv4::serve {

// Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
inline constexpr double kGreedyTemperature = 1e-5;
// A temperature above 0 and below this is raised to it (vLLM's _MAX_TEMP); 2 is the most.
inline constexpr double kMinSamplingTemperature = 1e-2;
inline constexpr double kMaxTemperature = 2.0;
// The temperature of a request that names none (vLLM's OpenAI default).
inline constexpr double kDefaultTemperature = 1.0;
// vLLM's default --max-logprobs.
inline constexpr int kDefaultMaxLogprobs = 20;
// The most choices one request may ask for (each costs a whole generation).
inline constexpr int kMaxChoices = 16;

struct SamplingParams {
  // vLLM's default (its _DEFAULT_SAMPLING_PARAMS) when the model names none.
  double temperature = kDefaultTemperature;
  double top_p = 1.0;
  int64_t top_k = 0;  // 0 or -1: off
  double min_p = 0.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double repetition_penalty = 1.0;
  std::optional<uint64_t> seed;  // the int64 as given, reinterpreted
  int min_tokens = 0;
  bool ignore_eos = false;
  // Top tokens per position to report besides the sampled one (-1: all); unset: no logprobs.
  std::optional<int64_t> logprobs;
  bool echo = false;
  int n = 1;
  // Tokens in logprobs as "token_id:<id>" (vLLM's return_tokens_as_token_ids).
  bool tokens_as_ids = false;

  bool greedy() const { return temperature < kGreedyTemperature; }
};

enum class Endpoint;

// Reads the sampling fields of `body` into `out` (through `f`, whose first error wins).
// `max_tokens` is the request's; `remote_decode`: a prefill's request (see above).
void ParseSamplingParams(kvwire::JsonFields& f, const nlohmann::json& body, Endpoint endpoint,
                         int max_tokens, bool remote_decode, SamplingParams* out);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_SAMPLING_PARAMS_H_
