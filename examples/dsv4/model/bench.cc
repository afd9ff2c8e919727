// dsv4-model-bench CONFIG.json [prompt_tokens=500] [decode_tokens=32] [threads=0]
// Generates the config's weights (under /tmp, once), then reports prefill and decode
// tokens/s of the CPU model. Not a test: it asserts nothing about speed.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "examples/dsv4/model/generate.h"
#include "examples/dsv4/model/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CONFIG.json [prompt_tokens] [decode_tokens] [threads]\n",
                 argv[0]);
    return 2;
  }
  const int prompt_tokens = argc > 2 ? std::atoi(argv[2]) : 500;
  const int decode_tokens = argc > 3 ? std::atoi(argv[3]) : 32;
  const int threads = argc > 4 ? std::atoi(argv[4]) : 0;
  absl::StatusOr<dsv4::Config> config = dsv4::Config::FromFile(argv[1]);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  const std::string weights =
      "/tmp/" + config->name + "-" + std::to_string(config->seed) + ".safetensors";
  if (absl::Status s = dsv4::EnsureWeights(*config, weights); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<dsv4::Model>> model = dsv4::Model::Load(*config, weights, threads);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const uint64_t blocks = (prompt_tokens + decode_tokens) / 64 + 8;
  absl::StatusOr<std::unique_ptr<dsv4::KvCache>> cache =
      dsv4::KvCache::Create(*config, blocks, 2, 1);
  if (!cache.ok()) {
    std::fprintf(stderr, "%s\n", cache.status().ToString().c_str());
    return 1;
  }
  std::vector<int32_t> prompt{dsv4::kBosToken};
  for (int i = 1; i < prompt_tokens; ++i) prompt.push_back('a' + (i * 7 + i / 13) % 26);
  dsv4::GenerateOptions options;
  options.max_tokens = decode_tokens + 1;
  options.stop_at_eos = false;
  absl::StatusOr<dsv4::GenerateResult> r =
      dsv4::GenerateFromTokens(**model, **cache, prompt, options);
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "config %s threads %d: prefill %d tokens in %.3f s = %.1f tokens/s; decode %d "
      "tokens in %.3f s = %.1f tokens/s\n",
      config->name.c_str(), threads, prompt_tokens, r->prefill_seconds,
      prompt_tokens / r->prefill_seconds, decode_tokens, r->decode_seconds,
      decode_tokens / r->decode_seconds);
  std::printf(
      "cpu: prefill %.3f s (%.1f tokens per cpu-second), decode %.3f s (%.1f tokens "
      "per cpu-second)\n",
      r->prefill_cpu_seconds, prompt_tokens / r->prefill_cpu_seconds, r->decode_cpu_seconds,
      decode_tokens / r->decode_cpu_seconds);
  std::printf("text: %s\n", r->text.c_str());
  return 0;
}
