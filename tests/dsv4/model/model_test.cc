// The whole model: determinism across thread counts and chunkings, prompt sensitivity,
// generation and sampling, and input validation.
#include "examples/dsv4/model/model.h"

#include <cmath>
#include <cstring>
#include <set>

#include <gtest/gtest.h>

#include "examples/dsv4/model/generate.h"
#include "examples/dsv4/model/tokenizer.h"
#include "tests/dsv4/model/tiny_model.h"

namespace dsv4 {
namespace {

std::unique_ptr<KvCache> NewCache(uint64_t seed, uint64_t blocks = 12) {
  absl::StatusOr<std::unique_ptr<KvCache>> c =
      KvCache::Create(TinyModelFiles::Get().config(), blocks, 2, seed);
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

// Runs `prompt` in the given chunks, then `decode` greedy steps; returns every logits vector.
std::vector<std::vector<float>> RunRequest(Model& model, KvCache& cache,
                                           const std::vector<int32_t>& prompt,
                                           const std::vector<int>& chunks, int decode) {
  absl::StatusOr<kvwire::BlockTable> table = cache.Allocate(prompt.size() + decode);
  EXPECT_TRUE(table.ok()) << table.status();
  std::vector<std::vector<float>> out;
  size_t pos = 0;
  for (int n : chunks) {
    absl::StatusOr<std::vector<float>> l =
        model.Forward(cache, *table, std::span<const int32_t>(prompt).subspan(pos, n), pos);
    EXPECT_TRUE(l.ok()) << l.status();
    out.push_back(*l);
    pos += n;
  }
  EXPECT_EQ(pos, prompt.size());
  for (int i = 0; i < decode; ++i) {
    const int32_t next = SampleToken(out.back(), 0.0f, 0, i);
    absl::StatusOr<std::vector<float>> l =
        model.Forward(cache, *table, std::span<const int32_t>(&next, 1), pos++);
    EXPECT_TRUE(l.ok()) << l.status();
    out.push_back(*l);
  }
  cache.Free(*table);
  EXPECT_EQ(cache.UsedBlocks(), 0u);
  return out;
}

bool BitIdentical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ModelTest, BitIdenticalWhateverTheThreadCount) {
  const std::vector<int32_t> prompt = TestPrompt(150);
  std::unique_ptr<Model> one = TinyModelFiles::Get().Load(1);
  std::unique_ptr<Model> three = TinyModelFiles::Get().Load(3);
  auto cache = NewCache(1);
  auto a = RunRequest(*one, *cache, prompt, {150}, 3);
  auto b = RunRequest(*three, *cache, prompt, {150}, 3);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(BitIdentical(a[i], b[i])) << "step " << i;
  for (float x : a.back()) ASSERT_TRUE(std::isfinite(x));
}

// Every token's math is independent of the batch it runs in, and every bit of state lives
// in the cache: chunked prefill equals one-shot prefill, in other blocks of another cache.
// (Chunks end inside compression windows and SWA blocks; TransferContractTest crosses 256.)
TEST(ModelTest, ChunkedPrefillMatchesOneShot) {
  const std::vector<int32_t> prompt = TestPrompt(200, 3);
  std::unique_ptr<Model> model = TinyModelFiles::Get().Load(2);
  auto c1 = NewCache(1), c2 = NewCache(2);
  auto whole = RunRequest(*model, *c1, prompt, {200}, 2);
  auto chunked = RunRequest(*model, *c2, prompt, {1, 2, 1, 60, 64, 1, 66, 5}, 2);
  EXPECT_TRUE(BitIdentical(whole.front(), chunked[7]));
  EXPECT_TRUE(BitIdentical(whole[1], chunked[8]));
  EXPECT_TRUE(BitIdentical(whole[2], chunked[9]));
}

TEST(ModelTest, OutputsDependOnThePrompt) {
  std::unique_ptr<Model> model = TinyModelFiles::Get().Load(2);
  auto cache = NewCache(1);
  std::set<std::vector<int32_t>> outputs;
  std::set<int32_t> tokens;
  for (const char* prompt : {"Hello world", "The quick brown fox", "1 2 3 4 5 6", "zzz"}) {
    GenerateOptions options;
    options.max_tokens = 8;
    absl::StatusOr<GenerateResult> r = Generate(*model, *cache, prompt, options);
    ASSERT_TRUE(r.ok()) << r.status();
    outputs.insert(r->tokens);
    tokens.insert(r->tokens.begin(), r->tokens.end());
  }
  EXPECT_EQ(outputs.size(), 4u) << "greedy continuations of different prompts differ";
  EXPECT_GE(tokens.size(), 4u) << "outputs do not collapse to one token";
  EXPECT_EQ(cache->UsedBlocks(), 0u);
}

TEST(ModelTest, GenerateMatchesManualLoopAndFreesBlocks) {
  std::unique_ptr<Model> model = TinyModelFiles::Get().Load(2);
  auto cache = NewCache(4);
  GenerateOptions options;
  options.max_tokens = 5;
  options.temperature = 0.8f;
  options.seed = 42;
  options.stop_at_eos = false;
  absl::StatusOr<GenerateResult> r = Generate(*model, *cache, "abcdef", options);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tokens.size(), 5u);
  EXPECT_EQ(r->prompt_tokens, Encode("abcdef"));
  EXPECT_EQ(cache->UsedBlocks(), 0u);
  absl::StatusOr<kvwire::BlockTable> t = cache->Allocate(12);
  ASSERT_TRUE(t.ok());
  std::vector<int32_t> seq = r->prompt_tokens;
  absl::StatusOr<std::vector<float>> l = model->Forward(*cache, *t, seq, 0);
  ASSERT_TRUE(l.ok());
  for (int k = 0; k < 5; ++k) {
    const int32_t next = SampleToken(*l, 0.8f, 42, k);
    ASSERT_EQ(next, r->tokens[k]) << "step " << k;
    l = model->Forward(*cache, *t, std::span<const int32_t>(&next, 1), seq.size());
    ASSERT_TRUE(l.ok());
    seq.push_back(next);
  }
  cache->Free(*t);
}

TEST(ModelTest, SampleToken) {
  const std::vector<float> logits = {0.0f, std::log(3.0f), -100.0f};
  EXPECT_EQ(SampleToken(logits, 0.0f, 1, 0), 1);
  EXPECT_EQ(SampleToken(logits, -1.0f, 1, 0), 1);
  int ones = 0;
  for (uint64_t step = 0; step < 4000; ++step) {
    const int32_t t = SampleToken(logits, 1.0f, 7, step);
    ASSERT_NE(t, 2);
    ones += t == 1;
    EXPECT_EQ(t, SampleToken(logits, 1.0f, 7, step)) << "keyed by (seed, step)";
  }
  EXPECT_NEAR(ones / 4000.0, 0.75, 0.03);
}

TEST(ModelTest, ForwardRejectsBadInput) {
  std::unique_ptr<Model> model = TinyModelFiles::Get().Load(1);
  auto cache = NewCache(1);
  absl::StatusOr<kvwire::BlockTable> t = cache->Allocate(64);
  ASSERT_TRUE(t.ok());
  const std::vector<int32_t> bad = {256, 300};
  EXPECT_EQ(model->Forward(*cache, *t, bad, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(model->Forward(*cache, *t, {}, 0).ok());
  const std::vector<int32_t> ok = {256, 65};
  absl::StatusOr<std::vector<float>> l = model->Forward(*cache, *t, ok, 63);  // needs 65 tokens
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("swa_kv"), std::string::npos) << l.status();
  kvwire::BlockTable missing = *t;
  missing.erase("c4a_indexer_k");
  EXPECT_FALSE(model->Forward(*cache, missing, ok, 0).ok());
  cache->Free(*t);
}

}  // namespace
}  // namespace dsv4
