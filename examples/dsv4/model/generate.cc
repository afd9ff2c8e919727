// Single-process generation.
#include "examples/dsv4/model/generate.h"

#include <chrono>
#include <filesystem>
#include <time.h>

#include "examples/dsv4/model/tokenizer.h"

namespace dsv4 {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Frees a request's blocks on every exit path.
class BlockGuard {
 public:
  BlockGuard(KvCache& cache, kvwire::BlockTable& table) : cache_(cache), table_(table) {}
  ~BlockGuard() { cache_.Free(table_); }
  BlockGuard(const BlockGuard&) = delete;
  BlockGuard& operator=(const BlockGuard&) = delete;

 private:
  KvCache& cache_;
  kvwire::BlockTable& table_;
};

}  // namespace

absl::StatusOr<GenerateResult> GenerateFromTokens(Model& model, KvCache& cache,
                                                  std::vector<int32_t> prompt_tokens,
                                                  const GenerateOptions& options) {
  if (prompt_tokens.empty()) return absl::InvalidArgumentError("Generate: empty prompt");
  GenerateResult result;
  result.prompt_tokens = std::move(prompt_tokens);
  const uint64_t n = result.prompt_tokens.size();
  absl::StatusOr<kvwire::BlockTable> allocated = cache.Allocate(n);
  if (!allocated.ok()) return allocated.status();
  kvwire::BlockTable table = std::move(*allocated);
  BlockGuard guard(cache, table);

  auto start = std::chrono::steady_clock::now();
  double cpu = CpuSeconds();
  absl::StatusOr<std::vector<float>> logits = model.Forward(cache, table, result.prompt_tokens, 0);
  if (!logits.ok()) return logits.status();
  result.prefill_seconds = Seconds(start);
  result.prefill_cpu_seconds = CpuSeconds() - cpu;
  start = std::chrono::steady_clock::now();
  cpu = CpuSeconds();
  while (static_cast<int>(result.tokens.size()) < options.max_tokens) {
    const int32_t next =
        SampleToken(*logits, options.temperature, options.seed, result.tokens.size());
    result.tokens.push_back(next);
    if ((options.stop_at_eos && next == kEosToken) ||
        static_cast<int>(result.tokens.size()) >= options.max_tokens) {
      break;
    }
    const uint64_t pos = n + result.tokens.size() - 1;
    if (absl::Status s = cache.Grow(table, pos + 1); !s.ok()) return s;
    logits = model.Forward(cache, table, std::span<const int32_t>(&next, 1), pos);
    if (!logits.ok()) return logits.status();
  }
  result.decode_seconds = Seconds(start);
  result.decode_cpu_seconds = CpuSeconds() - cpu;
  result.text = Decode(result.tokens);
  return result;
}

absl::StatusOr<GenerateResult> Generate(Model& model, KvCache& cache, std::string_view prompt,
                                        const GenerateOptions& options) {
  return GenerateFromTokens(model, cache, Encode(prompt), options);
}

absl::Status EnsureWeights(const Config& config, const std::string& path) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) return absl::OkStatus();
  return GenerateWeights(config, path);
}

}  // namespace dsv4
