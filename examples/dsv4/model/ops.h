// The DeepSeek-V4 operators as plain functions over float arrays, so each can be tested on
// its own against a double-precision reference. Every output element is one fixed-order
// reduction: results do not depend on how callers split the work across threads.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_OPS_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_OPS_H_

#include <cstdint>
#include <vector>

namespace dsv4 {

float Dot(const float* a, const float* b, int n);
// out = x * rsqrt(mean(x^2) + eps) * w (w may be null: no weight). out may alias x.
void RmsNorm(const float* x, const float* w, int n, float eps, float* out);
// Interleaved RoPE on `dims` values: pairs (x[2i], x[2i+1]) rotate by pos * theta^(-2i/dims);
// inverse rotates back.
void Rope(float* x, int dims, int64_t pos, float theta, bool inverse = false);

// Attention of one query head over `n` keys (shared K = V, 512 dims): softmax over
// q.k * scale with a sink logit in the denominator only; out = sum p_j k_j.
void AttendWithSink(const float* q, const float* const* keys, int n, int dim, float scale,
                    float sink, float* out);

// One compressed entry, per channel: softmax over the `n` tokens of score[.][c], then the
// weighted sum of kv[.][c]. Rows are `width` floats.
void CompressTokens(const float* const* kv, const float* const* score, int n, int width,
                    float* out);

// Lightning indexer: score_j = sum_h w_h * relu(q_h . k_j) for n keys of `dim`.
void IndexerScores(const float* q, const float* w, int heads, const float* const* keys, int n,
                   int dim, float* scores);
// Indices of the k largest scores (ties: lower index first), returned ascending.
std::vector<int> TopK(const float* scores, int n, int k);
// Compressed entries a query at `pos` may see: entry j (tokens ending at ratio * j +
// ratio - 1) is visible once pos >= ratio * j + ratio - 1.
inline int64_t VisibleEntries(int64_t pos, int ratio) { return (pos + 1) / ratio; }
// The indexer's choice for a query at `pos`: top-k by IndexerScores among the visible
// entries of keys[0, num_keys); ascending entry ids.
std::vector<int> IndexerSelect(const float* q, const float* w, int heads, const float* const* keys,
                               int64_t num_keys, int dim, int64_t pos, int ratio, int topk);

// MoE gate: sqrt(softplus(logit)) scores; experts chosen by top-k of score + bias (bias may
// be null), or given by `hash_experts` (k ids) on hash layers; weights are the chosen
// scores renormalised to sum 1, times `scaling`.
void RouteExperts(const float* logits, const float* bias, const int32_t* hash_experts,
                  int num_experts, int k, float scaling, int* experts, float* weights);
// Clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit).
float SwiGlu(float gate, float up, float limit);

// Hyper-connection mixing weights from the raw mixes (2 + hc) * hc: pre (hc), post (hc) and
// the Sinkhorn-normalised hc x hc comb (comb[i * hc + j]: stream i into stream j).
struct HcWeights {
  std::vector<float> pre, post, comb;
};
HcWeights HcSplitSinkhorn(const float* mixes, const float* scale, const float* base, int hc,
                          int iters, float eps);

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_OPS_H_
