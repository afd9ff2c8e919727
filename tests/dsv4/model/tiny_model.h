// The tiny config and its generated weights, shared by the model tests of one program.
// DSV4_CONFIG_DIR in the environment wins over the build's (a GPU bundle run elsewhere).
#ifndef KVWIRE_TESTS_DSV4_MODEL_TINY_MODEL_H_
#define KVWIRE_TESTS_DSV4_MODEL_TINY_MODEL_H_

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <unistd.h>

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/model.h"

namespace dsv4 {

class TinyModelFiles {
 public:
  static const TinyModelFiles& Get() {
    static const TinyModelFiles* files = new TinyModelFiles();
    return *files;
  }
  const Config& config() const { return config_; }
  const std::string& weights() const { return weights_; }
  std::unique_ptr<Model> Load(int threads) const {
    absl::StatusOr<std::unique_ptr<Model>> m = Model::Load(config_, weights_, threads);
    if (!m.ok()) {
      std::fprintf(stderr, "load: %s\n", m.status().ToString().c_str());
      std::abort();
    }
    return std::move(*m);
  }

 private:
  TinyModelFiles() {
    const char* env = std::getenv("DSV4_CONFIG_DIR");
    const std::string dir = env != nullptr ? env : DSV4_CONFIG_DIR;
    absl::StatusOr<Config> c = Config::FromFile(dir + "/tiny.json");
    if (!c.ok()) {
      std::fprintf(stderr, "config: %s\n", c.status().ToString().c_str());
      std::abort();
    }
    config_ = *c;
    weights_ = "/tmp/dsv4_tiny_test_" + std::to_string(getpid()) + ".safetensors";
    if (absl::Status s = GenerateWeights(config_, weights_); !s.ok()) {
      std::fprintf(stderr, "weights: %s\n", s.ToString().c_str());
      std::abort();
    }
    static std::string path = weights_;
    std::atexit([] { std::remove(path.c_str()); });
  }
  Config config_;
  std::string weights_;
};

// A prompt of `n` tokens: BOS and varied bytes.
inline std::vector<int32_t> TestPrompt(int n, int salt = 0) {
  std::vector<int32_t> p{256};
  for (int i = 1; i < n; ++i) p.push_back(32 + (i * 37 + salt * 11 + i / 7) % 90);
  p.resize(n);
  return p;
}

}  // namespace dsv4

#endif  // KVWIRE_TESTS_DSV4_MODEL_TINY_MODEL_H_
