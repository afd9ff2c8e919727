#include "examples/dsv4/serve/generation_output.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dsv4::serve {

using nlohmann::json;

namespace {

// OpenAI's floor for a logprob of -inf (JSON has no infinity).
double Finite(float lp) { return std::max<double>(lp, -9999.0); }

}  // namespace

GenerationOutput::GenerationOutput(const CompletionRequest& req, int32_t eos_token, DecodeFn decode,
                                   std::string echo_text)
    : endpoint_(req.endpoint),
      max_tokens_(req.max_tokens),
      min_tokens_(req.sampling.min_tokens),
      ignore_eos_(req.sampling.ignore_eos),
      logprobs_(req.sampling.logprobs.has_value()),
      tokens_as_ids_(req.sampling.tokens_as_ids),
      eos_(eos_token),
      decode_(std::move(decode)),
      echo_(req.sampling.echo ? std::move(echo_text) : ""),
      echo_pending_(req.sampling.echo),
      stop_(req.stop) {}

GenerationOutput::Step GenerationOutput::Feed(const Sampled& s) {
  Step step;
  generated_.push_back(s.token);
  lps_.push_back(s.logprobs);
  const int32_t one[] = {s.token};
  // vLLM matches stop strings once the output holds more than min_tokens tokens.
  const bool may_stop = static_cast<int>(generated_.size()) > min_tokens_;
  step.tokens = stop_.Feed(s.token, decode_(one), may_stop);
  const bool eos = s.token == eos_ && !ignore_eos_;
  step.done = stop_.stopped() || eos || static_cast<int>(generated_.size()) >= max_tokens_;
  if (step.done) {
    std::vector<int32_t> rest = stop_.Flush();
    step.tokens.insert(step.tokens.end(), rest.begin(), rest.end());
    step.finish_reason = stop_.stopped() || eos ? "stop" : "length";
  }
  const size_t from = emitted_.size();
  emitted_.insert(emitted_.end(), step.tokens.begin(), step.tokens.end());
  step.logprobs = LogprobsJson(from, emitted_.size());
  step.text = decode_(step.tokens);
  if (echo_pending_ && (!step.text.empty() || step.done)) {
    step.text = echo_ + step.text;
    echo_pending_ = false;
  }
  return step;
}

std::string GenerationOutput::text() const { return echo_ + decode_(emitted_); }

json GenerationOutput::logprobs() const { return LogprobsJson(0, emitted_.size()); }

json GenerationOutput::LogprobsJson(size_t from, size_t to) const {
  if (!logprobs_) return nullptr;
  auto token_text = [&](int32_t t) {
    if (tokens_as_ids_) return absl::StrCat("token_id:", t);
    const int32_t one[] = {t};
    return decode_(one);
  };
  auto bytes = [&](int32_t t) {
    const int32_t one[] = {t};
    std::vector<int> out;
    for (unsigned char c : decode_(one)) out.push_back(c);
    return out;
  };
  if (endpoint_ == Endpoint::kChat) {
    json content = json::array();
    for (size_t i = from; i < to; ++i) {
      const int32_t t = emitted_[i];
      json top = json::array();
      for (const auto& [id, lp] : lps_[i].top) {
        top.push_back({{"token", token_text(id)}, {"logprob", Finite(lp)}, {"bytes", bytes(id)}});
      }
      content.push_back({{"token", token_text(t)},
                         {"logprob", Finite(lps_[i].logprob)},
                         {"bytes", bytes(t)},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
       offsets = json::array();
  size_t offset = echo_.size() + decode_(std::span<const int32_t>(emitted_.data(), from)).size();
  for (size_t i = from; i < to; ++i) {
    const int32_t t = emitted_[i];
    tokens.push_back(token_text(t));
    token_logprobs.push_back(Finite(lps_[i].logprob));
    // As vLLM: the sampled token and the top ones, keyed by their text.
    json top = json::object();
    top[token_text(t)] = Finite(lps_[i].logprob);
    for (const auto& [id, lp] : lps_[i].top) top[token_text(id)] = Finite(lp);
    top_logprobs.push_back(std::move(top));
    offsets.push_back(offset);
    const int32_t one[] = {t};
    offset += decode_(one).size();
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(offsets)}};
}

}  // namespace dsv4::serve
