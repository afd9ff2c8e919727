// The tensors of a DeepSeek-V4 model (names, shapes, dtypes) and their deterministic
// generation: GenerateWeights (model.h) writes them, Model::Load checks a file against them.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_WEIGHTS_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_WEIGHTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "examples/dsv4/model/config.h"

namespace dsv4 {

enum class Init {
  kLinear,    // uniform, variance gain^2 / fan_in (fan_in = last dim)
  kEmbed,     // uniform, variance 1
  kOnes,      // norm weights
  kUniform,   // uniform in [-range, range]
  kConstant,  // every element = range
  kHashTable  // I32 [vocab, k]: k distinct experts per token
};

struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype = "F32";
  Init init = Init::kLinear;
  float range = 0.0f;
  int64_t numel() const;
};

std::vector<WeightSpec> WeightSpecs(const Config& config);

// Generated contents of one tensor (F32 as floats; I32 as int32 bit patterns in `ints`).
struct GeneratedTensor {
  std::vector<float> floats;
  std::vector<int32_t> ints;
};
GeneratedTensor GenerateTensor(const Config& config, const WeightSpec& spec);

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_WEIGHTS_H_
