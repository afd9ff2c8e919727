// The DeepSeek-V4 reference model: one layer's mixture of experts (Model::Impl::Moe): the
// routing (RouteExperts, ops.h), the routed experts, and the shared expert.
#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "examples/dsv4/model/model_impl.h"

namespace dsv4 {

void Model::Impl::RunExpert(const Expert& ex, const float* X, const std::vector<int>& rows,
                            float* out) {
  const int dim = config.dim, n = static_cast<int>(rows.size());
  std::vector<float> hidden(int64_t{n} * ex.inter);
  pool.ParallelFor(ex.inter, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int i = 0; i < n; ++i) {
        const float* x = X + int64_t{rows[i]} * dim;
        hidden[int64_t{i} * ex.inter + r] =
            SwiGlu(Dot(ex.w1 + r * dim, x, dim), Dot(ex.w3 + r * dim, x, dim), config.swiglu_limit);
      }
    }
  });
  pool.ParallelFor(dim, [&](int64_t b, int64_t e) {
    for (int64_t d = b; d < e; ++d) {
      for (int i = 0; i < n; ++i) {
        out[int64_t{i} * dim + d] =
            Dot(ex.w2 + d * ex.inter, hidden.data() + int64_t{i} * ex.inter, ex.inter);
      }
    }
  });
}

void Model::Impl::Moe(int l, const float* Yn, std::span<const int32_t> tokens, float* out) {
  const Config& c = config;
  const Layer& L = layers_[l];
  const int T = static_cast<int>(tokens.size()), E = c.num_experts, K = c.experts_per_token;
  const int dim = c.dim;
  std::vector<float> logits(int64_t{T} * E);
  Linear(L.gate, E, dim, Yn, T, logits.data());
  std::vector<int> chosen(int64_t{T} * K);
  std::vector<float> weights(int64_t{T} * K);
  for (int t = 0; t < T; ++t) {
    const int32_t* hash = L.tid2eid != nullptr ? L.tid2eid + int64_t{tokens[t]} * K : nullptr;
    RouteExperts(logits.data() + int64_t{t} * E, L.gate_bias, hash, E, K, c.routed_scaling_factor,
                 chosen.data() + int64_t{t} * K, weights.data() + int64_t{t} * K);
  }
  // Per (token, slot) outputs, then a fixed-order sum per token.
  std::vector<float> slot_out(int64_t{T} * K * dim);
  for (int e = 0; e < E; ++e) {
    std::vector<int> rows, slots;
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        if (chosen[int64_t{t} * K + k] == e) {
          rows.push_back(t);
          slots.push_back(t * K + k);
        }
      }
    }
    if (rows.empty()) continue;
    std::vector<float> y(rows.size() * dim);
    RunExpert(L.experts[e], Yn, rows, y.data());
    for (size_t i = 0; i < rows.size(); ++i) {
      std::copy(y.begin() + i * dim, y.begin() + (i + 1) * dim,
                slot_out.begin() + int64_t{slots[i]} * dim);
    }
  }
  if (c.num_shared_experts > 0) {
    std::vector<int> all(T);
    for (int t = 0; t < T; ++t) all[t] = t;
    RunExpert(L.shared, Yn, all, out);
  } else {
    std::fill(out, out + int64_t{T} * dim, 0.0f);
  }
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const float w = weights[int64_t{t} * K + k];
      const float* y = slot_out.data() + (int64_t{t} * K + k) * dim;
      for (int d = 0; d < dim; ++d) out[int64_t{t} * dim + d] += w * y[d];
    }
  }
}

}  // namespace dsv4
