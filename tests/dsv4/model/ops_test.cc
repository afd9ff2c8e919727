// Each operator against a straightforward double-precision reference.
#include "examples/dsv4/model/ops.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace dsv4 {
namespace {

std::vector<float> Random(std::mt19937& rng, size_t n, float stddev = 1.0f) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(OpsTest, DotAndRmsNorm) {
  std::mt19937 rng(1);
  for (int n : {1, 7, 8, 9, 64, 513}) {
    auto a = Random(rng, n), b = Random(rng, n), w = Random(rng, n);
    double ref = 0, ss = 0;
    for (int i = 0; i < n; ++i) ref += static_cast<double>(a[i]) * b[i];
    EXPECT_NEAR(Dot(a.data(), b.data(), n), ref, 1e-5 * n);
    for (int i = 0; i < n; ++i) ss += static_cast<double>(a[i]) * a[i];
    std::vector<float> out(n);
    RmsNorm(a.data(), w.data(), n, 1e-6f, out.data());
    for (int i = 0; i < n; ++i) {
      EXPECT_NEAR(out[i], a[i] / std::sqrt(ss / n + 1e-6) * w[i], 1e-5) << n << " " << i;
    }
  }
}

TEST(OpsTest, RopeRotatesInterleavedPairsAndInverts) {
  std::mt19937 rng(2);
  auto x = Random(rng, 64);
  auto y = x;
  const int64_t pos = 1234;
  Rope(y.data(), 64, pos, 10000.0f);
  for (int i = 0; i < 32; ++i) {
    const double angle = pos * std::pow(10000.0, -2.0 * i / 64);
    EXPECT_NEAR(y[2 * i], x[2 * i] * std::cos(angle) - x[2 * i + 1] * std::sin(angle), 1e-5);
    EXPECT_NEAR(y[2 * i + 1], x[2 * i] * std::sin(angle) + x[2 * i + 1] * std::cos(angle), 1e-5);
  }
  Rope(y.data(), 64, pos, 10000.0f, /*inverse=*/true);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
}

// Attention with a sink over a window of keys plus compressed entries (all one key list).
TEST(OpsTest, AttentionWithSinkMatchesReference) {
  std::mt19937 rng(3);
  const int dim = 512;
  for (int n : {1, 5, 128, 128 + 37}) {
    for (float sink : {-3.0f, 0.0f, 4.0f}) {
      auto q = Random(rng, dim);
      std::vector<std::vector<float>> k(n);
      std::vector<const float*> kp(n);
      for (int j = 0; j < n; ++j) {
        k[j] = Random(rng, dim, 0.2f);
        kp[j] = k[j].data();
      }
      const float scale = 1.0f / std::sqrt(512.0f);
      std::vector<float> out(dim);
      AttendWithSink(q.data(), kp.data(), n, dim, scale, sink, out.data());
      std::vector<double> logit(n);
      double m = sink, denom = 0;
      for (int j = 0; j < n; ++j) {
        double s = 0;
        for (int d = 0; d < dim; ++d) s += static_cast<double>(q[d]) * k[j][d];
        logit[j] = s * scale;
        m = std::max(m, logit[j]);
      }
      for (int j = 0; j < n; ++j) denom += std::exp(logit[j] - m);
      denom += std::exp(sink - m);
      double mass = 0;
      for (int d = 0; d < dim; ++d) {
        double ref = 0;
        for (int j = 0; j < n; ++j) ref += std::exp(logit[j] - m) / denom * k[j][d];
        ASSERT_NEAR(out[d], ref, 1e-5) << "n " << n << " sink " << sink << " dim " << d;
      }
      for (int j = 0; j < n; ++j) mass += std::exp(logit[j] - m) / denom;
      // The sink takes its share: the weights on real keys sum to less than one.
      EXPECT_LT(mass, 1.0);
    }
  }
}

// Compressor: per-channel softmax over the tokens of the window (8 overlapping for ratio 4,
// 128 for ratio 128), then the weighted sum.
TEST(OpsTest, CompressTokensMatchesReference) {
  std::mt19937 rng(4);
  for (int n : {4, 8, 128}) {
    const int width = 512;
    std::vector<std::vector<float>> kv(n), sc(n);
    std::vector<const float*> kp(n), sp(n);
    for (int t = 0; t < n; ++t) {
      kv[t] = Random(rng, width);
      sc[t] = Random(rng, width, 3.0f);
      kp[t] = kv[t].data();
      sp[t] = sc[t].data();
    }
    std::vector<float> out(width);
    CompressTokens(kp.data(), sp.data(), n, width, out.data());
    for (int c = 0; c < width; ++c) {
      double m = -1e300, denom = 0, sum = 0;
      for (int t = 0; t < n; ++t) m = std::max(m, static_cast<double>(sc[t][c]));
      for (int t = 0; t < n; ++t) {
        denom += std::exp(sc[t][c] - m);
        sum += std::exp(sc[t][c] - m) * kv[t][c];
      }
      ASSERT_NEAR(out[c], sum / denom, 1e-5) << "n " << n << " channel " << c;
    }
  }
}

TEST(OpsTest, IndexerScoresAndTopK) {
  std::mt19937 rng(5);
  const int heads = 4, dim = 128, n = 75;
  auto q = Random(rng, heads * dim), w = Random(rng, heads);
  std::vector<std::vector<float>> k(n);
  std::vector<const float*> kp(n);
  for (int j = 0; j < n; ++j) {
    k[j] = Random(rng, dim);
    kp[j] = k[j].data();
  }
  std::vector<float> scores(n);
  IndexerScores(q.data(), w.data(), heads, kp.data(), n, dim, scores.data());
  std::vector<double> ref(n);
  for (int j = 0; j < n; ++j) {
    for (int h = 0; h < heads; ++h) {
      double s = 0;
      for (int d = 0; d < dim; ++d) s += static_cast<double>(q[h * dim + d]) * k[j][d];
      ref[j] += std::max(0.0, s) * w[h];
    }
    ASSERT_NEAR(scores[j], ref[j], 1e-4) << j;
  }
  // Top-k with causal visibility: a query at position i sees entry j only if i >= 4j + 3.
  for (int i : {0, 2, 3, 6, 7, 40, 299, 400}) {
    const int k_top = 16;
    std::vector<int> got = IndexerSelect(q.data(), w.data(), heads, kp.data(), n, dim, i, 4, k_top);
    std::vector<int> want;
    for (int j = 0; j < n; ++j) {
      if (i >= 4 * j + 3) want.push_back(j);
    }
    std::sort(want.begin(), want.end(), [&](int a, int b) { return ref[a] > ref[b]; });
    want.resize(std::min<size_t>(want.size(), k_top));
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want) << "query position " << i;
  }
  EXPECT_EQ(VisibleEntries(126, 128), 0);
  EXPECT_EQ(VisibleEntries(127, 128), 1);
  // Ties go to the lower index.
  const float tied[] = {1, 3, 3, 2, 3};
  EXPECT_EQ(TopK(tied, 5, 2), (std::vector<int>{1, 2}));
}

TEST(OpsTest, MoeRoutingWithBiasAndHash) {
  const int E = 8, K = 2;
  std::mt19937 rng(6);
  auto logits = Random(rng, E, 2.0f);
  std::vector<double> score(E);
  for (int e = 0; e < E; ++e) score[e] = std::sqrt(std::log1p(std::exp(double{logits[e]})));
  int experts[K];
  float weights[K];
  // No bias: the two highest scores.
  RouteExperts(logits.data(), nullptr, nullptr, E, K, 1.5f, experts, weights);
  std::vector<int> order(E);
  for (int e = 0; e < E; ++e) order[e] = e;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return score[a] > score[b]; });
  EXPECT_EQ(experts[0], order[0]);
  EXPECT_EQ(experts[1], order[1]);
  const double sum = score[order[0]] + score[order[1]];
  EXPECT_NEAR(weights[0], score[order[0]] / sum * 1.5, 1e-6);
  EXPECT_NEAR(weights[1], score[order[1]] / sum * 1.5, 1e-6);
  // A bias changes the choice but not the weights' source: the lowest-scoring expert wins
  // with a large bias, and its weight still comes from its unbiased score.
  std::vector<float> bias(E, 0.0f);
  bias[order[E - 1]] = 100.0f;
  RouteExperts(logits.data(), bias.data(), nullptr, E, K, 1.0f, experts, weights);
  EXPECT_EQ(experts[0], order[E - 1]);
  EXPECT_EQ(experts[1], order[0]);
  EXPECT_NEAR(weights[0], score[order[E - 1]] / (score[order[E - 1]] + score[order[0]]), 1e-6);
  // Hash routing: the table decides, scores still weigh.
  const int32_t hash[K] = {5, 2};
  RouteExperts(logits.data(), bias.data(), hash, E, K, 2.0f, experts, weights);
  EXPECT_EQ(experts[0], 5);
  EXPECT_EQ(experts[1], 2);
  EXPECT_NEAR(weights[0], score[5] / (score[5] + score[2]) * 2.0, 1e-6);
  EXPECT_NEAR(weights[0] + weights[1], 2.0, 1e-6);
}

TEST(OpsTest, SwiGluClamps) {
  auto silu = [](double x) { return x / (1 + std::exp(-x)); };
  EXPECT_NEAR(SwiGlu(1.0f, 2.0f, 10.0f), silu(1.0) * 2.0, 1e-6);
  EXPECT_NEAR(SwiGlu(50.0f, 2.0f, 10.0f), silu(10.0) * 2.0, 1e-5);    // gate clamped above
  EXPECT_NEAR(SwiGlu(-50.0f, 2.0f, 10.0f), silu(-50.0) * 2.0, 1e-6);  // not below
  EXPECT_NEAR(SwiGlu(1.0f, -30.0f, 10.0f), silu(1.0) * -10.0, 1e-5);  // up clamped both ways
  EXPECT_NEAR(SwiGlu(1.0f, 30.0f, 10.0f), silu(1.0) * 10.0, 1e-5);
}

TEST(OpsTest, HyperConnectionSinkhornMatchesReference) {
  std::mt19937 rng(7);
  const int hc = 4, iters = 20;
  const float eps = 1e-6f;
  auto mixes = Random(rng, (2 + hc) * hc, 2.0f), base = Random(rng, (2 + hc) * hc, 0.5f);
  const float scale[3] = {0.7f, 0.9f, 1.3f};
  HcWeights w = HcSplitSinkhorn(mixes.data(), scale, base.data(), hc, iters, eps);
  auto sigmoid = [](double x) { return 1 / (1 + std::exp(-x)); };
  for (int i = 0; i < hc; ++i) {
    EXPECT_NEAR(w.pre[i], sigmoid(mixes[i] * 0.7 + base[i]) + eps, 1e-6);
    EXPECT_NEAR(w.post[i], 2 * sigmoid(mixes[hc + i] * 0.9 + base[hc + i]), 1e-6);
  }
  double c[hc][hc];
  for (int i = 0; i < hc; ++i) {
    double m = -1e300, s = 0;
    for (int j = 0; j < hc; ++j) {
      c[i][j] = mixes[2 * hc + i * hc + j] * 1.3 + base[2 * hc + i * hc + j];
      m = std::max(m, c[i][j]);
    }
    for (int j = 0; j < hc; ++j) s += c[i][j] = std::exp(c[i][j] - m);
    for (int j = 0; j < hc; ++j) c[i][j] = c[i][j] / s + eps;
  }
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {
      for (int i = 0; i < hc; ++i) {
        double s = 0;
        for (int j = 0; j < hc; ++j) s += c[i][j];
        for (int j = 0; j < hc; ++j) c[i][j] /= s + eps;
      }
    }
    for (int j = 0; j < hc; ++j) {
      double s = 0;
      for (int i = 0; i < hc; ++i) s += c[i][j];
      for (int i = 0; i < hc; ++i) c[i][j] /= s + eps;
    }
  }
  for (int i = 0; i < hc; ++i) {
    double row = 0, col = 0;
    for (int j = 0; j < hc; ++j) {
      EXPECT_NEAR(w.comb[i * hc + j], c[i][j], 1e-5);
      EXPECT_GE(w.comb[i * hc + j], 0.0f);
      row += w.comb[i * hc + j];
      col += w.comb[j * hc + i];
    }
    // Doubly stochastic (up to convergence) after the iterations.
    EXPECT_NEAR(row, 1.0, 5e-2);  // 20 iterations approach it; the column pass is last
    EXPECT_NEAR(col, 1.0, 1e-5);
  }
}

}  // namespace
}  // namespace dsv4
