// vLLM's sampling parameters in one process: their parsing and bounds (sampling_params.h),
// their effect on the sampler (sampler.h; the distribution it draws from, the filters,
// penalties, min_tokens, logprobs) and on what a choice shows (generation_output.h:
// ignore_eos, min_tokens against EOS and stop strings, echo, the logprobs' shapes).
#include <cmath>
#include <map>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "examples/dsv4/model/model.h"
#include "examples/dsv4/model/tokenizer.h"
#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/generation_output.h"
#include "examples/dsv4/serve/sampler.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;

constexpr int kVocab = 258;

CompletionRequest Parse(const std::string& body, Endpoint e = Endpoint::kCompletions) {
  absl::StatusOr<CompletionRequest> r = ParseCompletionRequest(body, kVocab, e);
  EXPECT_TRUE(r.ok()) << r.status() << " " << body;
  return r.ok() ? *r : CompletionRequest{};
}

// The error of a refused body; it must name `field`.
void ExpectRefused(const std::string& body, const std::string& field,
                   Endpoint e = Endpoint::kCompletions) {
  absl::StatusOr<CompletionRequest> r = ParseCompletionRequest(body, kVocab, e);
  ASSERT_FALSE(r.ok()) << body;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'" + field + "'"), std::string::npos)
      << r.status() << " for " << body;
}

TEST(SamplingParams, AcceptedWithVllmBounds) {
  CompletionRequest r = Parse(
      R"({"prompt":"a","max_tokens":9,"temperature":0.7,"top_p":0.9,"top_k":40,"min_p":0.05,
          "seed":-3,"presence_penalty":-2,"frequency_penalty":2,"repetition_penalty":1.3,
          "ignore_eos":true,"min_tokens":9,"logprobs":3,
          "return_tokens_as_token_ids":true})");
  const SamplingParams& p = r.sampling;
  EXPECT_DOUBLE_EQ(p.temperature, 0.7);
  EXPECT_DOUBLE_EQ(p.top_p, 0.9);
  EXPECT_EQ(p.top_k, 40);
  EXPECT_DOUBLE_EQ(p.min_p, 0.05);
  EXPECT_EQ(p.seed, static_cast<uint64_t>(-3));
  EXPECT_DOUBLE_EQ(p.presence_penalty, -2);
  EXPECT_DOUBLE_EQ(p.frequency_penalty, 2);
  EXPECT_DOUBLE_EQ(p.repetition_penalty, 1.3);
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_EQ(p.min_tokens, 9);
  EXPECT_EQ(p.logprobs, 3);
  EXPECT_TRUE(Parse(R"({"prompt":"a","echo":true})").sampling.echo);
  EXPECT_TRUE(p.tokens_as_ids);
  // Defaults: vLLM's temperature 1 (not greedy), no seed (a random one per request), no
  // logprobs; -1 turns top_k off; a null temperature is the default too.
  CompletionRequest d =
      Parse(R"({"prompt":"a","top_k":-1,"logprobs":null,"seed":null,"temperature":null})");
  EXPECT_FALSE(d.sampling.greedy());
  EXPECT_DOUBLE_EQ(d.sampling.temperature, 1.0);
  EXPECT_TRUE(Parse(R"({"prompt":"a","temperature":0})").sampling.greedy());
  // n > 1 needs sampling, which is the default.
  EXPECT_EQ(Parse(R"({"prompt":"a","n":2})").sampling.n, 2);
  EXPECT_FALSE(d.sampling.seed.has_value());
  EXPECT_FALSE(d.sampling.logprobs.has_value());
  EXPECT_EQ(d.sampling.top_k, 0);
  EXPECT_EQ(Parse(R"({"prompt":"a","logprobs":-1})").sampling.logprobs, -1);
  // vLLM: seed -1 is none; a temperature below 0.01 is raised to it; n > 1 when sampling.
  EXPECT_FALSE(Parse(R"({"prompt":"a","seed":-1})").sampling.seed.has_value());
  EXPECT_DOUBLE_EQ(Parse(R"({"prompt":"a","temperature":0.001})").sampling.temperature, 0.01);
  EXPECT_EQ(Parse(R"({"prompt":"a","n":16,"temperature":2})").sampling.n, 16);
  // Chat: logprobs is a switch, top_logprobs the count; max_completion_tokens wins (vLLM).
  CompletionRequest c = Parse(
      R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":4,
          "max_tokens":3,"max_completion_tokens":7})",
      Endpoint::kChat);
  EXPECT_EQ(c.sampling.logprobs, 4);
  EXPECT_EQ(c.max_tokens, 7);
  EXPECT_EQ(
      Parse(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true})", Endpoint::kChat)
          .sampling.logprobs,
      0);
  EXPECT_FALSE(
      Parse(R"({"messages":[{"role":"user","content":"x"}],"logprobs":false})", Endpoint::kChat)
          .sampling.logprobs.has_value());
}

TEST(SamplingParams, OutOfBoundsIsRefusedByName) {
  const std::pair<const char*, const char*> bad[] = {
      {R"({"prompt":"a","temperature":-0.1})", "temperature"},
      {R"({"prompt":"a","temperature":2.5})", "temperature"},
      {R"({"prompt":"a","top_p":0})", "top_p"},
      {R"({"prompt":"a","top_p":1.01})", "top_p"},
      {R"({"prompt":"a","top_k":-2})", "top_k"},
      {R"({"prompt":"a","top_k":1.5})", "top_k"},
      {R"({"prompt":"a","min_p":1.5})", "min_p"},
      {R"({"prompt":"a","presence_penalty":2.5})", "presence_penalty"},
      {R"({"prompt":"a","frequency_penalty":-2.01})", "frequency_penalty"},
      {R"({"prompt":"a","repetition_penalty":0})", "repetition_penalty"},
      {R"({"prompt":"a","seed":18446744073709551615})", "seed"},
      {R"({"prompt":"a","seed":"1"})", "seed"},
      {R"({"prompt":"a","ignore_eos":1})", "ignore_eos"},
      {R"({"prompt":"a","min_tokens":-1})", "min_tokens"},
      {R"({"prompt":"a","max_tokens":4,"min_tokens":5})", "min_tokens"},
      {R"({"prompt":"a","logprobs":-2})", "logprobs"},
      {R"({"prompt":"a","logprobs":true})", "logprobs"},
      {R"({"prompt":"a","echo":true,"logprobs":1})", "echo"},
      {R"({"prompt":"a","n":0})", "n"},
      {R"({"prompt":"a","n":17,"temperature":1})", "n"},
      {R"({"prompt":"a","n":2,"temperature":0})", "n"},  // greedy: every choice the same
      {R"({"prompt":"a","best_of":2})", "best_of"},
      {R"({"prompt":"a","prompt_logprobs":1})", "prompt_logprobs"},
  };
  for (const auto& [body, field] : bad) ExpectRefused(body, field);
  const std::pair<const char*, const char*> bad_chat[] = {
      {R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", "top_logprobs"},
      {R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":-2})",
       "top_logprobs"},
      {R"({"messages":[{"role":"user","content":"x"}],"logprobs":3})", "logprobs"},
      {R"({"messages":[{"role":"user","content":"x"}],"echo":true})", "echo"},
  };
  for (const auto& [body, field] : bad_chat) ExpectRefused(body, field, Endpoint::kChat);
  // A prefill's request (vLLM's proxies send it with max_tokens 1 and the client's
  // min_tokens): the relation binds the decode only.
  CompletionRequest p = Parse(
      R"({"prompt":"a","max_tokens":1,"min_tokens":5,
          "kv_transfer_params":{"do_remote_decode":true}})");
  EXPECT_EQ(p.sampling.min_tokens, 1);
}

// Logits whose softmax at temperature 1 is {0.5, 0.3, 0.15, 0.05}.
std::vector<float> FourLogits() {
  return {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
}

SamplingParams Sampling(double temperature) {
  SamplingParams p;
  p.temperature = temperature;
  return p;
}

// How often each token is drawn over `draws` seeds.
std::map<int32_t, int> Histogram(const SamplingParams& p, const std::vector<float>& logits,
                                 int draws, const std::vector<int32_t>& output = {}) {
  std::map<int32_t, int> h;
  for (int s = 0; s < draws; ++s) {
    ++h[Sampler(p, static_cast<uint64_t>(s) * 7919, {}, kEosToken).Next(logits, output).token];
  }
  return h;
}

TEST(Sampler, DrawsFromTheTemperedDistribution) {
  const std::vector<float> l = FourLogits();
  constexpr int kDraws = 20000;
  for (double t : {1.0, 0.5}) {
    const std::map<int32_t, int> h = Histogram(Sampling(t), l, kDraws);
    double z = 0;
    for (float x : l) z += std::exp(x / t);
    for (int32_t i = 0; i < 4; ++i) {
      const double want = std::exp(l[i] / t) / z;
      const double got = h.count(i) ? h.at(i) / static_cast<double>(kDraws) : 0.0;
      // Five standard deviations of a binomial proportion.
      EXPECT_NEAR(got, want, 5 * std::sqrt(want * (1 - want) / kDraws) + 1e-3)
          << "token " << i << " at temperature " << t;
    }
  }
}

TEST(Sampler, SeededDrawsAreTheReferenceEnginesAndKeyedBySeedAndStep) {
  std::vector<float> l(kVocab);
  for (int i = 0; i < kVocab; ++i) l[i] = std::sin(i * 0.37f) * 3;
  const SamplingParams p = Sampling(0.8);
  int differ = 0;
  for (uint64_t seed = 1; seed <= 64; ++seed) {
    std::vector<int32_t> out;
    for (int step = 0; step < 4; ++step) {
      const int32_t t = Sampler(p, seed, {}, kEosToken).Next(l, out).token;
      // `generate` (one process) draws with SampleToken: the servers draw the same tokens.
      EXPECT_EQ(t, SampleToken(l, 0.8f, seed, step)) << "seed " << seed << " step " << step;
      EXPECT_EQ(t, Sampler(p, seed, {}, kEosToken).Next(l, out).token) << "not reproducible";
      out.push_back(t);
    }
    if (Sampler(p, seed, {}, kEosToken).Next(l, {}).token !=
        Sampler(p, seed + 1000, {}, kEosToken).Next(l, {}).token) {
      ++differ;
    }
  }
  EXPECT_GT(differ, 32) << "other seeds should draw other tokens";
  EXPECT_NE(RandomSeed(), RandomSeed());
}

TEST(Sampler, TopKTopPAndMinPKeepOnlyTheLikelyTokens) {
  const std::vector<float> l = FourLogits();
  SamplingParams p = Sampling(1.0);
  p.top_k = 2;
  std::map<int32_t, int> h = Histogram(p, l, 4000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_GT(h[0], 0);
  EXPECT_GT(h[1], 0);
  // top_p 0.75: 0.05 and 0.15 fall within the least likely 0.25 and go; 0.3 and 0.5 stay.
  p = Sampling(1.0);
  p.top_p = 0.75;
  h = Histogram(p, l, 4000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_NEAR(h[0] / 4000.0, 0.5 / 0.8, 0.05);
  // min_p 0.5: tokens under half the top probability (0.25) go.
  p = Sampling(1.0);
  p.min_p = 0.5;
  h = Histogram(p, l, 4000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_GT(h[1], 0);
  // Each alone at its tightest is greedy.
  for (int which = 0; which < 3; ++which) {
    p = Sampling(5.0);
    if (which == 0) p.top_k = 1;
    if (which == 1) p.top_p = 1e-6;
    if (which == 2) p.min_p = 1.0;
    EXPECT_EQ(Histogram(p, l, 500), (std::map<int32_t, int>{{0, 500}})) << which;
  }
  // Greedy ignores the filters.
  p = Sampling(0.0);
  p.top_k = 3;
  EXPECT_EQ(Histogram(p, l, 50), (std::map<int32_t, int>{{0, 50}}));
}

TEST(Sampler, PenaltiesAsVllm) {
  // Greedy over {2.0, 1.9, -1.0, 1.0}.
  const std::vector<float> l = {2.0f, 1.9f, -1.0f, 1.0f};
  auto greedy = [&](SamplingParams p, std::vector<int32_t> prompt, std::vector<int32_t> out) {
    return Sampler(p, 0, std::move(prompt), -1).Next(l, out).token;
  };
  SamplingParams p = Sampling(0);
  EXPECT_EQ(greedy(p, {}, {}), 0);
  // repetition_penalty 1.5 divides positive logits of prompt and output tokens (2.0 -> 1.33).
  p.repetition_penalty = 1.5;
  EXPECT_EQ(greedy(p, {0}, {}), 1) << "from the prompt";
  EXPECT_EQ(greedy(p, {}, {0}), 1) << "from the output";
  // Below 1 it favours them: 1.9 / 0.5 = 3.8 beats 2.0.
  p.repetition_penalty = 0.5;
  EXPECT_EQ(greedy(p, {1}, {}), 1);
  // frequency_penalty counts occurrences in the output only (not the prompt).
  p = Sampling(0);
  p.frequency_penalty = 0.06;
  EXPECT_EQ(greedy(p, {0, 0, 0}, {}), 0);
  EXPECT_EQ(greedy(p, {}, {0}), 0) << "2.0 - 0.06 > 1.9";
  EXPECT_EQ(greedy(p, {}, {0, 0}), 1) << "2.0 - 0.12 < 1.9";
  // presence_penalty once per token present; negative ones favour it.
  p = Sampling(0);
  p.presence_penalty = 0.2;
  EXPECT_EQ(greedy(p, {}, {0, 0, 0}), 1);
  // Once, not per occurrence: 2.0 - 0.06 > 1.9 however often token 0 came out.
  p.presence_penalty = 0.06;
  EXPECT_EQ(greedy(p, {}, {0, 0}), 0) << "presence applied per occurrence";
  p.presence_penalty = -1.5;
  EXPECT_EQ(greedy(p, {}, {3}), 3);
  // repetition_penalty multiplies negative logits (vLLM): -1.0 * 1.5 = -1.5 < -1.2.
  const std::vector<float> negative = {-1.0f, -1.2f};
  p = Sampling(0);
  p.repetition_penalty = 1.5;
  EXPECT_EQ(Sampler(p, 0, {0}, -1).Next(negative, {}).token, 1) << "negative logit divided";
}

TEST(Sampler, MinTokensMasksEosUntilThenOnly) {
  std::vector<float> l(kVocab, 0.0f);
  l[kEosToken] = 10.0f;
  l[65] = 5.0f;
  SamplingParams p = Sampling(0);
  p.min_tokens = 3;
  Sampler s(p, 0, {}, kEosToken);
  EXPECT_EQ(s.Next(l, {}).token, 65);
  EXPECT_EQ(s.Next(l, {65, 65}).token, 65);
  EXPECT_EQ(s.Next(l, {65, 65, 65}).token, kEosToken);
  // Sampled too: EOS never drawn before min_tokens, even at a high temperature.
  p.temperature = 3.0;
  EXPECT_EQ(Histogram(p, l, 2000, {65}).count(kEosToken), 0u);
  p.min_tokens = 0;
  EXPECT_GT(Histogram(p, l, 2000, {65}).count(kEosToken), 0u);
}

TEST(Sampler, LogprobsAreTheModelsAndSumToOne) {
  std::vector<float> l(kVocab);
  for (int i = 0; i < kVocab; ++i) l[i] = std::cos(i * 0.11f) * 4;
  SamplingParams p = Sampling(0.7);
  p.logprobs = -1;
  p.top_k = 5;  // filters change the draw, not the reported distribution (raw_logprobs)
  const Sampled s = Sampler(p, 9, {}, kEosToken).Next(l, {});
  ASSERT_EQ(s.logprobs.top.size(), static_cast<size_t>(kVocab));
  double sum = 0;
  for (size_t i = 0; i < s.logprobs.top.size(); ++i) {
    sum += std::exp(s.logprobs.top[i].second);
    if (i > 0) {
      EXPECT_GE(s.logprobs.top[i - 1].second, s.logprobs.top[i].second);
    }
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
  EXPECT_FLOAT_EQ(s.logprobs.logprob, LogSoftmax(l)[s.token]);
  p.logprobs = 2;
  const Sampled two = Sampler(p, 9, {}, kEosToken).Next(l, {});
  ASSERT_EQ(two.logprobs.top.size(), 2u);
  EXPECT_EQ(two.token, s.token) << "asking for logprobs does not change the draw";
  p.logprobs.reset();
  EXPECT_TRUE(Sampler(p, 9, {}, kEosToken).Next(l, {}).logprobs.top.empty());
}

std::string Text(std::span<const int32_t> t) { return Decode(t); }

Sampled Tok(int32_t t, float lp = -1.0f) {
  Sampled s;
  s.token = t;
  s.logprobs.logprob = lp;
  s.logprobs.top = {{t, lp}, {t == 'z' ? 'y' : 'z', lp - 1}};
  return s;
}

// Feeds `tokens`; returns the steps until done.
std::vector<GenerationOutput::Step> FeedAll(GenerationOutput& o,
                                            const std::vector<int32_t>& tokens) {
  std::vector<GenerationOutput::Step> steps;
  for (int32_t t : tokens) {
    steps.push_back(o.Feed(Tok(t)));
    if (steps.back().done) break;
  }
  return steps;
}

TEST(GenerationOutput, IgnoreEosRunsToMaxTokens) {
  CompletionRequest r = Parse(R"({"prompt":"a","max_tokens":5,"ignore_eos":true})");
  GenerationOutput o(r, kEosToken, Text, "a");
  std::vector<GenerationOutput::Step> steps = FeedAll(o, {'x', kEosToken, 'y', kEosToken, 'z'});
  ASSERT_EQ(steps.size(), 5u);
  EXPECT_STREQ(steps.back().finish_reason, "length");
  EXPECT_EQ(o.emitted().size(), 5u) << "EOS is a token of the output";
  EXPECT_EQ(o.text(), "xyz");
  r.sampling.ignore_eos = false;
  GenerationOutput stops(r, kEosToken, Text, "a");
  steps = FeedAll(stops, {'x', kEosToken, 'y'});
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_STREQ(steps.back().finish_reason, "stop");
}

TEST(GenerationOutput, MinTokensHoldsStopStringsBack) {
  // "b" stops the output only once more than min_tokens tokens exist (vLLM's rule).
  CompletionRequest r = Parse(R"({"prompt":"a","max_tokens":8,"min_tokens":3,"stop":"b"})");
  GenerationOutput o(r, kEosToken, Text, "");
  std::vector<GenerationOutput::Step> steps = FeedAll(o, {'a', 'b', 'c', 'b', 'd'});
  ASSERT_EQ(steps.size(), 4u);
  EXPECT_STREQ(steps.back().finish_reason, "stop");
  EXPECT_EQ(o.text(), "abc");
  r.sampling.min_tokens = 0;
  GenerationOutput early(r, kEosToken, Text, "");
  steps = FeedAll(early, {'a', 'b', 'c'});
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(early.text(), "a");
}

TEST(GenerationOutput, EchoAndCompletionLogprobs) {
  CompletionRequest r = Parse(R"({"prompt":"Hi","max_tokens":2,"echo":true,"stream":true})");
  GenerationOutput o(r, kEosToken, Text, "Hi");
  std::vector<GenerationOutput::Step> steps = FeedAll(o, {'x', 'y'});
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].text, "Hix") << "the prompt comes first, once";
  EXPECT_EQ(steps[1].text, "y");
  EXPECT_EQ(o.text(), "Hixy");
  EXPECT_TRUE(o.logprobs().is_null());

  r = Parse(R"({"prompt":"Hi","max_tokens":2,"logprobs":1})");
  GenerationOutput lp(r, kEosToken, Text, "Hi");
  FeedAll(lp, {'x', 'y'});
  const json j = lp.logprobs();
  EXPECT_EQ(j["tokens"], json::array({"x", "y"}));
  EXPECT_EQ(j["token_logprobs"], json::array({-1.0, -1.0}));
  EXPECT_EQ(j["text_offset"], json::array({0, 1}));
  EXPECT_EQ(j["top_logprobs"][0], json({{"x", -1.0}, {"z", -2.0}}));
  r.sampling.tokens_as_ids = true;
  GenerationOutput ids(r, kEosToken, Text, "Hi");
  FeedAll(ids, {'x'});
  EXPECT_EQ(ids.logprobs()["tokens"], json::array({"token_id:120"}));
}

TEST(GenerationOutput, ChatLogprobs) {
  CompletionRequest r = Parse(
      R"({"messages":[{"role":"user","content":"x"}],"max_tokens":1,"logprobs":true,
          "top_logprobs":2})",
      Endpoint::kChat);
  GenerationOutput o(r, kEosToken, Text, "");
  FeedAll(o, {'x'});
  const json c = o.logprobs()["content"];
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0]["token"], "x");
  EXPECT_EQ(c[0]["bytes"], json::array({120}));
  EXPECT_EQ(c[0]["logprob"], -1.0);
  ASSERT_EQ(c[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(c[0]["top_logprobs"][1]["token"], "z");
}

}  // namespace
}  // namespace dsv4::serve
