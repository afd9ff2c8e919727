// Model::Impl (model.h), shared by the files that implement it, one job each:
//   model.cc            weight loading, the forward pass over the layers, hyper-connection
//                       mixing, the public facade, SampleToken
//   model_attention.cc  one layer's attention: its KV writes into the paged cache (SWA,
//                       compressed entries, indexer keys, compressor state rings) and the
//                       attention over them (CPU, or the executor's kernels)
//   model_moe.cc        one layer's mixture of experts (routing, experts, shared expert)
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_MODEL_IMPL_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_MODEL_IMPL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/kv_cache.h"
#include "examples/dsv4/model/model.h"
#include "examples/dsv4/model/ops.h"
#include "examples/dsv4/model/thread_pool.h"

namespace dsv4 {
namespace model_internal {

struct Expert {
  const float* w1 = nullptr;  // [inter, dim]
  const float* w2 = nullptr;  // [dim, inter]
  const float* w3 = nullptr;  // [inter, dim]
  int inter = 0;
};

struct HcParams {
  const float* fn = nullptr;
  const float* base = nullptr;
  const float* scale = nullptr;
};

struct Compressor {
  const float* wkv = nullptr;
  const float* wgate = nullptr;
  const float* ape = nullptr;
  const float* norm = nullptr;
};

struct Layer {
  int ratio = 0;
  float theta = 0;
  HcParams hc_attn, hc_ffn;
  const float *attn_norm, *ffn_norm;
  const float *wq_a, *q_norm, *wq_b, *wkv, *kv_norm, *sink, *wo_a, *wo_b;
  Compressor comp, index_comp;
  const float *index_wq_b = nullptr, *index_weights = nullptr;
  const float *gate = nullptr, *gate_bias = nullptr;
  const int32_t* tid2eid = nullptr;
  std::vector<Expert> experts;
  Expert shared;
};

// One state ring of a request: `ring` slots of `floats` floats ([kv | score]).
struct Ring {
  float* base = nullptr;
  int ring = 0;
  int floats = 0;
  float* Slot(int64_t token) const { return base + (token % ring) * floats; }
};

}  // namespace model_internal

class Model::Impl {
 public:
  using Compressor = model_internal::Compressor;
  using Expert = model_internal::Expert;
  using HcParams = model_internal::HcParams;
  using Layer = model_internal::Layer;
  using Ring = model_internal::Ring;

  Impl(const Config& c, int threads) : config(c), pool(threads) {}

  absl::Status LoadWeights(const std::string& path);
  absl::StatusOr<std::vector<float>> Forward(KvCache& cache, const kvwire::BlockTable& blocks,
                                             std::span<const int32_t> tokens, uint64_t pos,
                                             const std::function<void(int)>& on_layer_done);

  Config config;
  ThreadPool pool;

 private:
  // y[t][o] = w[o] . x[t] for t < T.
  void Linear(const float* w, int out, int in, const float* x, int T, float* y) {
    pool.ParallelFor(out, [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o) {
        const float* row = w + o * in;
        for (int t = 0; t < T; ++t) y[int64_t{t} * out + o] = Dot(row, x + int64_t{t} * in, in);
      }
    });
  }
  void HcPre(const HcParams& p, const float* X, int T, float* Y, std::vector<HcWeights>& mix);
  void HcPost(const std::vector<HcWeights>& mix, const float* A, int T, float* X);
  absl::Status Attention(int l, KvCache& cache, const kvwire::BlockTable& blocks, const float* Yn,
                         std::span<const int32_t> tokens, int64_t pos, float* out,
                         const std::function<void(int)>& on_layer_done);
  void Moe(int l, const float* Yn, std::span<const int32_t> tokens, float* out);
  void RunExpert(const Expert& e, const float* X, const std::vector<int>& rows, float* out);

  const float* F(const std::string& name) const { return floats_.at(name).data(); }

  std::map<std::string, std::vector<float>> floats_;
  std::map<std::string, std::vector<int32_t>> ints_;
  std::vector<Layer> layers_;
};

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_MODEL_IMPL_H_
