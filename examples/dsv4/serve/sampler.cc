#include "examples/dsv4/serve/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace dsv4::serve {

namespace {

constexpr float kMasked = -std::numeric_limits<float>::infinity();

// SplitMix64 of (seed, step), in [0, 1): the draw of step k is the same in every process (the
// reference engine's SampleToken draws the same way).
double Uniform(uint64_t seed, uint64_t step) {
  uint64_t z = seed + (step + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1p-53;
}

int32_t Argmax(std::span<const float> v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Penalties as vLLM applies them: repetition over prompt and output, then frequency and
// presence over the output.
void ApplyPenalties(const SamplingParams& p, const std::vector<int32_t>& prompt,
                    const std::vector<int32_t>& output, std::vector<float>& l) {
  const auto in_range = [&](int32_t t) { return t >= 0 && static_cast<size_t>(t) < l.size(); };
  if (p.repetition_penalty != 1.0) {
    std::vector<char> seen(l.size(), 0);
    for (const std::vector<int32_t>* v : {&prompt, &output}) {
      for (int32_t t : *v) {
        if (in_range(t)) seen[t] = 1;
      }
    }
    const float rp = static_cast<float>(p.repetition_penalty);
    for (size_t t = 0; t < l.size(); ++t) {
      if (seen[t]) l[t] = l[t] > 0 ? l[t] / rp : l[t] * rp;
    }
  }
  if (p.frequency_penalty == 0.0 && p.presence_penalty == 0.0) return;
  std::vector<int> counts(l.size(), 0);
  for (int32_t t : output) {
    if (in_range(t)) ++counts[t];
  }
  for (size_t t = 0; t < l.size(); ++t) {
    if (counts[t] == 0) continue;
    l[t] -= static_cast<float>(p.frequency_penalty) * static_cast<float>(counts[t]);
    l[t] -= static_cast<float>(p.presence_penalty);
  }
}

// Unnormalised probabilities after temperature, then min_p, top_k and top_p (zero: removed).
std::vector<double> Weights(const SamplingParams& p, const std::vector<float>& l) {
  const float m = *std::max_element(l.begin(), l.end());
  // As a float, as the reference engine's SampleToken takes it (its draws are the same).
  const float t = static_cast<float>(p.temperature);
  std::vector<double> w(l.size());
  for (size_t i = 0; i < l.size(); ++i) {
    w[i] = l[i] == kMasked ? 0.0 : std::exp((static_cast<double>(l[i]) - m) / t);
  }
  if (p.min_p > 0) {  // relative to the most likely token, whose weight is 1
    for (double& x : w) {
      if (x < p.min_p) x = 0;
    }
  }
  const bool top_k = p.top_k > 0 && static_cast<size_t>(p.top_k) < w.size();
  if (!top_k && p.top_p >= 1.0) return w;
  std::vector<size_t> order(w.size());
  std::iota(order.begin(), order.end(), 0);
  // Descending by weight; ties by token id.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w[a] > w[b]; });
  if (top_k) {  // ties with the k-th weight stay, as vLLM's threshold keeps them
    const double kth = w[order[static_cast<size_t>(p.top_k) - 1]];
    for (double& x : w) {
      if (x < kth) x = 0;
    }
  }
  if (p.top_p < 1.0) {
    // vLLM: drop the least likely tokens while their cumulative share stays <= 1 - top_p;
    // the most likely token always stays.
    const double sum = std::accumulate(w.begin(), w.end(), 0.0);
    double cum = 0;
    for (size_t r = order.size(); r-- > 1;) {
      const size_t i = order[r];
      if (w[i] == 0) continue;
      cum += w[i] / sum;
      if (cum > 1.0 - p.top_p) break;
      w[i] = 0;
    }
  }
  return w;
}

}  // namespace

std::vector<float> LogSoftmax(std::span<const float> logits) {
  std::vector<float> out(logits.size());
  if (logits.empty()) return out;
  const double m = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - m);
  const double log_sum = std::log(sum) + m;
  for (size_t i = 0; i < logits.size(); ++i) {
    out[i] = static_cast<float>(static_cast<double>(logits[i]) - log_sum);
  }
  return out;
}

uint64_t RandomSeed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

Sampler::Sampler(const SamplingParams& params, uint64_t seed, std::vector<int32_t> prompt,
                 int32_t eos_token)
    : params_(params), seed_(seed), prompt_(std::move(prompt)), eos_(eos_token) {}

Sampled Sampler::Next(std::span<const float> logits, const std::vector<int32_t>& output) const {
  Sampled s;
  if (logits.empty()) return s;
  std::vector<float> l(logits.begin(), logits.end());
  if (static_cast<int>(output.size()) < params_.min_tokens && eos_ >= 0 &&
      static_cast<size_t>(eos_) < l.size()) {
    l[eos_] = kMasked;
  }
  ApplyPenalties(params_, prompt_, output, l);
  if (params_.greedy()) {
    s.token = Argmax(l);
  } else {
    const std::vector<double> w = Weights(params_, l);
    double sum = 0;
    for (double x : w) sum += x;
    const double u = Uniform(seed_, output.size()) * sum;
    double acc = 0;
    s.token = -1;
    for (size_t i = 0; i < w.size() && s.token < 0; ++i) {
      acc += w[i];
      if (w[i] > 0 && u < acc) s.token = static_cast<int32_t>(i);
    }
    if (s.token < 0) {  // rounding at the very end: the last token that may be drawn
      for (size_t i = w.size(); i-- > 0 && s.token < 0;) {
        if (w[i] > 0) s.token = static_cast<int32_t>(i);
      }
    }
    if (s.token < 0) s.token = Argmax(l);
  }
  if (params_.logprobs) {
    const std::vector<float> lp = LogSoftmax(logits);
    s.logprobs.logprob = lp[s.token];
    const size_t k = *params_.logprobs < 0
                         ? lp.size()
                         : std::min(lp.size(), static_cast<size_t>(*params_.logprobs));
    std::vector<int32_t> order(lp.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(
        order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
        [&](int32_t a, int32_t b) { return lp[a] > lp[b] || (lp[a] == lp[b] && a < b); });
    for (size_t i = 0; i < k; ++i) s.logprobs.top.emplace_back(order[i], lp[order[i]]);
  }
  return s;
}

}  // namespace dsv4::serve
