// DeepSeek-V4 operators.
#include "examples/dsv4/model/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace dsv4 {

float Dot(const float* a, const float* b, int n) {
  // Eight independent partial sums in a fixed order: vectorisable without -ffast-math.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void RmsNorm(const float* x, const float* w, int n, float eps, float* out) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) out[i] = x[i] * r * (w != nullptr ? w[i] : 1.0f);
}

void Rope(float* x, int dims, int64_t pos, float theta, bool inverse) {
  for (int i = 0; i < dims / 2; ++i) {
    const double freq = std::pow(static_cast<double>(theta), -2.0 * i / dims);
    const double angle = static_cast<double>(pos) * freq * (inverse ? -1.0 : 1.0);
    const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

void AttendWithSink(const float* q, const float* const* keys, int n, int dim, float scale,
                    float sink, float* out) {
  std::vector<float> logits(n);
  float m = sink;
  for (int j = 0; j < n; ++j) {
    logits[j] = Dot(q, keys[j], dim) * scale;
    m = std::max(m, logits[j]);
  }
  float denom = std::exp(sink - m);
  for (int j = 0; j < n; ++j) {
    logits[j] = std::exp(logits[j] - m);
    denom += logits[j];
  }
  std::fill(out, out + dim, 0.0f);
  for (int j = 0; j < n; ++j) {
    const float p = logits[j] / denom;
    const float* k = keys[j];
    for (int d = 0; d < dim; ++d) out[d] += p * k[d];
  }
}

void CompressTokens(const float* const* kv, const float* const* score, int n, int width,
                    float* out) {
  for (int c = 0; c < width; ++c) {
    float m = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) m = std::max(m, score[t][c]);
    float denom = 0.0f, sum = 0.0f;
    for (int t = 0; t < n; ++t) {
      const float e = std::exp(score[t][c] - m);
      denom += e;
      sum += e * kv[t][c];
    }
    out[c] = sum / denom;
  }
}

void IndexerScores(const float* q, const float* w, int heads, const float* const* keys, int n,
                   int dim, float* scores) {
  for (int j = 0; j < n; ++j) {
    float s = 0.0f;
    for (int h = 0; h < heads; ++h) s += std::max(0.0f, Dot(q + h * dim, keys[j], dim)) * w[h];
    scores[j] = s;
  }
}

std::vector<int> TopK(const float* scores, int n, int k) {
  std::vector<int> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  if (k < n) {
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
      return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
    });
    idx.resize(k);
    std::sort(idx.begin(), idx.end());
  }
  return idx;
}

std::vector<int> IndexerSelect(const float* q, const float* w, int heads, const float* const* keys,
                               int64_t num_keys, int dim, int64_t pos, int ratio, int topk) {
  const int visible = static_cast<int>(std::min(num_keys, VisibleEntries(pos, ratio)));
  std::vector<float> scores(visible);
  IndexerScores(q, w, heads, keys, visible, dim, scores.data());
  return TopK(scores.data(), visible, topk);
}

void RouteExperts(const float* logits, const float* bias, const int32_t* hash_experts,
                  int num_experts, int k, float scaling, int* experts, float* weights) {
  std::vector<float> score(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    const float x = logits[e];
    // softplus(x) = log1p(exp(x)), computed without overflow.
    const float sp = x > 20.0f ? x : std::log1p(std::exp(x));
    score[e] = std::sqrt(sp);
  }
  if (hash_experts != nullptr) {
    for (int i = 0; i < k; ++i) experts[i] = hash_experts[i];
  } else {
    std::vector<float> biased(score);
    if (bias != nullptr) {
      for (int e = 0; e < num_experts; ++e) biased[e] += bias[e];
    }
    std::vector<int> idx(num_experts);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
      return biased[a] != biased[b] ? biased[a] > biased[b] : a < b;
    });
    for (int i = 0; i < k; ++i) experts[i] = idx[i];
  }
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum += score[experts[i]];
  for (int i = 0; i < k; ++i) weights[i] = score[experts[i]] / sum * scaling;
}

float SwiGlu(float gate, float up, float limit) {
  const float g = std::min(gate, limit);
  const float u = std::clamp(up, -limit, limit);
  return g / (1.0f + std::exp(-g)) * u;
}

HcWeights HcSplitSinkhorn(const float* mixes, const float* scale, const float* base, int hc,
                          int iters, float eps) {
  HcWeights w;
  w.pre.resize(hc);
  w.post.resize(hc);
  w.comb.resize(hc * hc);
  auto sigmoid = [](float x) { return 1.0f / (1.0f + std::exp(-x)); };
  for (int i = 0; i < hc; ++i) {
    w.pre[i] = sigmoid(mixes[i] * scale[0] + base[i]) + eps;
    w.post[i] = 2.0f * sigmoid(mixes[hc + i] * scale[1] + base[hc + i]);
  }
  float* c = w.comb.data();
  for (int i = 0; i < hc * hc; ++i) c[i] = mixes[2 * hc + i] * scale[2] + base[2 * hc + i];
  // Row softmax, then alternate column and row normalisation towards a doubly stochastic
  // matrix (the first column pass counts as iteration one).
  for (int i = 0; i < hc; ++i) {
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < hc; ++j) m = std::max(m, c[i * hc + j]);
    float s = 0.0f;
    for (int j = 0; j < hc; ++j) s += c[i * hc + j] = std::exp(c[i * hc + j] - m);
    for (int j = 0; j < hc; ++j) c[i * hc + j] = c[i * hc + j] / s + eps;
  }
  auto normalize_columns = [&] {
    for (int j = 0; j < hc; ++j) {
      float s = 0.0f;
      for (int i = 0; i < hc; ++i) s += c[i * hc + j];
      for (int i = 0; i < hc; ++i) c[i * hc + j] /= s + eps;
    }
  };
  normalize_columns();
  for (int it = 1; it < iters; ++it) {
    for (int i = 0; i < hc; ++i) {
      float s = 0.0f;
      for (int j = 0; j < hc; ++j) s += c[i * hc + j];
      for (int j = 0; j < hc; ++j) c[i * hc + j] /= s + eps;
    }
    normalize_columns();
  }
  return w;
}

}  // namespace dsv4
