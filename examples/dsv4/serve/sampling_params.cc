#include "examples/dsv4/serve/sampling_params.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

#include "examples/dsv4/serve/completion_api.h"

namespace dsv4::serve {

using kvwire::JsonFields;
using nlohmann::json;

namespace {

constexpr double kHuge = std::numeric_limits<double>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// A logprobs count above every vocabulary (the server checks its own bound).
constexpr int64_t kMaxLogprobsField = 1 << 20;

// top_k: -1 or 0 (off), or at least 1.
int64_t ParseTopK(JsonFields& f) {
  const int64_t k = f.OptInt("top_k", -1, kInt64Max, 0);
  return k < 0 ? 0 : k;
}

}  // namespace

void ParseSamplingParams(JsonFields& f, const json& body, Endpoint endpoint, int max_tokens,
                         bool remote_decode, SamplingParams* out) {
  SamplingParams& p = *out;
  p.temperature = f.OptNumber("temperature", 0, kMaxTemperature, p.temperature);
  if (p.temperature > 0 && p.temperature < kMinSamplingTemperature) {
    p.temperature = kMinSamplingTemperature;  // vLLM: smaller ones overflow
  }
  p.top_p = f.OptNumber("top_p", 0, 1, p.top_p);
  if (f.ok() && f.Has("top_p") && !(p.top_p > 0)) {
    f.Fail("top_p", "must be in (0, 1]", body.at("top_p"));
  }
  p.top_k = ParseTopK(f);
  p.min_p = f.OptNumber("min_p", 0, 1, p.min_p);
  p.presence_penalty = f.OptNumber("presence_penalty", -2, 2, p.presence_penalty);
  p.frequency_penalty = f.OptNumber("frequency_penalty", -2, 2, p.frequency_penalty);
  p.repetition_penalty = f.OptNumber("repetition_penalty", 0, kHuge, p.repetition_penalty);
  if (f.ok() && f.Has("repetition_penalty") && !(p.repetition_penalty > 0)) {
    f.Fail("repetition_penalty", "must be greater than zero", body.at("repetition_penalty"));
  }
  if (f.Has("seed")) {
    const int64_t seed = f.Int("seed", kInt64Min, kInt64Max);
    if (seed != -1) p.seed = static_cast<uint64_t>(seed);  // vLLM: -1 is no seed
  }
  p.ignore_eos = f.OptBool("ignore_eos", p.ignore_eos);
  p.min_tokens = static_cast<int>(f.OptInt("min_tokens", 0, 1000000, p.min_tokens));
  if (f.ok() && p.min_tokens > max_tokens) {
    if (remote_decode) {
      p.min_tokens = max_tokens;  // the prefill's one token; decode checks the relation
    } else {
      f.Fail("min_tokens", absl::StrCat("must be at most max_tokens (", max_tokens, ")"),
             body.at("min_tokens"));
    }
  }
  p.n = static_cast<int>(f.OptInt("n", 1, kMaxChoices, p.n));
  if (f.ok() && p.n > 1 && p.greedy()) {
    f.Fail("n", "must be 1 when sampling is greedy (temperature 0)", body.at("n"));
  }
  p.tokens_as_ids = f.OptBool("return_tokens_as_token_ids", p.tokens_as_ids);
  if (endpoint == Endpoint::kChat) {
    const bool logprobs = f.OptBool("logprobs", false);
    const int64_t top = f.OptInt("top_logprobs", -1, kMaxLogprobsField, 0);
    if (f.ok() && top != 0 && !logprobs) {
      f.Fail("top_logprobs", "needs \"logprobs\": true", body.at("top_logprobs"));
    }
    if (logprobs) p.logprobs = top;
    if (f.ok() && f.Has("echo") && f.OptBool("echo", false)) {
      f.Fail("echo", "is not supported on /v1/chat/completions (false is)");
    }
  } else {
    if (f.Has("logprobs")) p.logprobs = f.Int("logprobs", -1, kMaxLogprobsField);
    p.echo = f.OptBool("echo", p.echo);
    if (f.ok() && p.echo && p.logprobs) {
      // vLLM returns the prompt's logprobs then: this engine computes only the last position.
      f.Fail("echo", "with logprobs is not supported (the prompt's logprobs are not computed)");
    }
  }
}

}  // namespace dsv4::serve
