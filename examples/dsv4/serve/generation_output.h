// What one choice of a completion shows the client, token by token: stop strings (held back
// until they are known not to match; not matched before min_tokens tokens, as vLLM), EOS (the
// end unless ignore_eos), max_tokens, the logprobs of the released tokens in the endpoint's
// shape, and the echoed prompt ahead of the first text.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_GENERATION_OUTPUT_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_GENERATION_OUTPUT_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/sampler.h"
#include "examples/dsv4/serve/stop_strings.h"

namespace dsv4::serve {

// The text of token ids (bytes that belong together are decoded together).
using DecodeFn = std::function<std::string(std::span<const int32_t>)>;

class GenerationOutput {
 public:
  GenerationOutput() = default;
  // `echo_text`: the prompt as text when the request asks for echo (else ignored).
  GenerationOutput(const CompletionRequest& req, int32_t eos_token, DecodeFn decode,
                   std::string echo_text);

  struct Step {
    std::vector<int32_t> tokens;  // released now
    std::string text;             // their text (and the echoed prompt, the first time)
    nlohmann::json logprobs;      // theirs, in the endpoint's shape; null without logprobs
    bool done = false;
    const char* finish_reason = nullptr;  // "stop" or "length" once done
  };

  // Takes the next generated token.
  Step Feed(const Sampled& s);

  // Everything released so far, for a non-streamed answer.
  const std::vector<int32_t>& emitted() const { return emitted_; }
  std::string text() const;
  nlohmann::json logprobs() const;

 private:
  // The logprobs of emitted_[from, to) in the endpoint's shape (null without logprobs).
  nlohmann::json LogprobsJson(size_t from, size_t to) const;

  Endpoint endpoint_ = Endpoint::kCompletions;
  int max_tokens_ = 0, min_tokens_ = 0;
  bool ignore_eos_ = false, logprobs_ = false, tokens_as_ids_ = false;
  int32_t eos_ = -1;
  DecodeFn decode_;
  std::string echo_;
  bool echo_pending_ = false;
  StopMatcher stop_;
  std::vector<int32_t> generated_;
  std::vector<TokenLogprobs> lps_;  // one per generated token
  std::vector<int32_t> emitted_;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_GENERATION_OUTPUT_H_
