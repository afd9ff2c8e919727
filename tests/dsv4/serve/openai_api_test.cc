// The OpenAI surface of the dsv4 servers, in one process: request parsing (token-id prompts,
// chat messages and their template, stop strings, stream_options, vLLM's null fields, refusal
// of what the servers cannot honour) and the stop-string matcher.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/stop_strings.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;

constexpr int kVocab = 258;

TEST(OpenAiRequest, TokenIdPromptsInEveryForm) {
  for (const char* body : {R"({"prompt":[256,72,105]})", R"({"prompt":[[256,72,105]]})"}) {
    auto r = ParseCompletionRequest(body, kVocab);
    ASSERT_TRUE(r.ok()) << r.status() << " " << body;
    ASSERT_TRUE(r->prompt_ids.has_value());
    EXPECT_EQ(*r->prompt_ids, (std::vector<int32_t>{256, 72, 105}));
  }
  auto text = ParseCompletionRequest(R"({"prompt":["Hi"]})", kVocab);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->prompt, "Hi");
  EXPECT_FALSE(text->prompt_ids.has_value());
  for (const char* body :
       {R"({"prompt":[258]})", R"({"prompt":[-1]})", R"({"prompt":[1.5]})", R"({"prompt":[]})",
        R"({"prompt":[[1],[2]]})", R"({"prompt":["a",1]})", R"({"prompt":[true]})"}) {
    auto r = ParseCompletionRequest(body, kVocab);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_NE(r.status().message().find("'prompt'"), std::string::npos) << r.status();
  }
}

TEST(OpenAiRequest, UnsupportedParametersAreRefusedByName) {
  auto r = ParseCompletionRequest(R"({"prompt":"a","logit_bias":{"1":1},"suffix":"z","best_of":1})",
                                  kVocab);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'logit_bias'"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("'suffix'"), std::string::npos) << r.status();
  EXPECT_EQ(r.status().message().find("'best_of'"), std::string::npos) << r.status();
  // Defaults (what the server does anyway) and nulls (not given) are served.
  auto ok = ParseCompletionRequest(
      R"({"prompt":"a","n":1,"top_p":1,"presence_penalty":0,"frequency_penalty":0.0,
          "echo":false,"logprobs":null,"min_tokens":null,"min_completion_tokens":null,
          "logit_bias":{},"user":"u","suffix":null,"whatever":null})",
      kVocab);
  EXPECT_TRUE(ok.ok()) << ok.status();
  // Chat-only parameters on /v1/completions, and the other way round.
  auto cross = ParseCompletionRequest(R"({"prompt":"a","max_completion_tokens":3})", kVocab);
  ASSERT_FALSE(cross.ok());
  EXPECT_NE(cross.status().message().find("'max_completion_tokens'"), std::string::npos);
  auto chat_prompt = ParseCompletionRequest(
      R"({"messages":[{"role":"user","content":"x"}],"prompt":"a"})", kVocab, Endpoint::kChat);
  ASSERT_FALSE(chat_prompt.ok());
  EXPECT_NE(chat_prompt.status().message().find("'prompt'"), std::string::npos);
}

TEST(OpenAiRequest, StopAndStreamOptions) {
  auto r = ParseCompletionRequest(
      R"({"prompt":"a","stop":["\n\n","END"],"stream":true,"stream_options":{"include_usage":true}})",
      kVocab);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_TRUE(r->include_usage);
  auto one = ParseCompletionRequest(R"({"prompt":"a","stop":"x"})", kVocab);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->stop, std::vector<std::string>{"x"});
  const std::pair<const char*, const char*> bad[] = {
      {R"({"prompt":"a","stop":5})", "'stop'"},
      {R"({"prompt":"a","stop":[""]})", "'stop'"},
      {R"({"prompt":"a","stop":[1]})", "stop[0]"},
      {R"({"prompt":"a","stop":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]})",
       "'stop'"},
      {R"({"prompt":"a","stream_options":{"include_usage":true}})", "'stream_options'"},
      {R"({"prompt":"a","stream":true,"stream_options":{"include_usage":"yes"}})",
       "'include_usage'"},
      {R"({"prompt":"a","stream":true,"stream_options":{"continuous_usage_stats":true}})",
       "'continuous_usage_stats'"},
      {R"({"prompt":"a","stream":true,"stream_options":{"other":1}})", "'other'"},
  };
  for (const auto& [body, want] : bad) {
    auto e = ParseCompletionRequest(body, kVocab);
    ASSERT_FALSE(e.ok()) << body;
    EXPECT_NE(e.status().message().find(want), std::string::npos) << e.status() << " " << body;
  }
}

TEST(OpenAiRequest, VllmProxyKvTransferParamsWithNulls) {
  auto r = ParseCompletionRequest(
      R"({"prompt":"a","max_tokens":1,"stream":false,"kv_transfer_params":{
          "do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,
          "remote_block_ids":null,"remote_host":null,"remote_port":null}})",
      kVocab);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->kv.do_remote_decode);
  EXPECT_FALSE(r->kv.do_remote_prefill);
  EXPECT_EQ(r->kv_transfer_params,
            json({{"do_remote_decode", true}, {"do_remote_prefill", false}}));
}

TEST(OpenAiRequest, ChatTemplate) {
  auto r = ParseCompletionRequest(
      R"({"messages":[{"role":"system","content":"Be terse."},
                      {"role":"user","content":[{"type":"text","text":"Hi"},
                                                {"type":"text","text":" there"}]},
                      {"role":"assistant","content":"Hello."},
                      {"role":"user","content":"Again"}],
          "max_completion_tokens":4,"stream":true})",
      kVocab, Endpoint::kChat);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt,
            "<|system|>\nBe terse.\n<|user|>\nHi there\n<|assistant|>\nHello.\n<|user|>\nAgain\n"
            "<|assistant|>\n");
  EXPECT_EQ(r->max_tokens, 4);
  EXPECT_EQ(r->endpoint, Endpoint::kChat);
  const std::pair<const char*, const char*> bad[] = {
      {R"({})", "'messages'"},
      {R"({"messages":[]})", "'messages'"},
      {R"({"messages":[{"role":"tool","content":"x"}]})", "'role'"},
      {R"({"messages":[{"role":"user"}]})", "'content'"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url","text":"x"}]}]})", "'type'"},
      {R"({"messages":[{"role":"user","content":"x","tool_calls":[]}]})", "'tool_calls'"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":[]})", "'tools'"},
  };
  for (const auto& [body, want] : bad) {
    auto e = ParseCompletionRequest(body, kVocab, Endpoint::kChat);
    ASSERT_FALSE(e.ok()) << body;
    EXPECT_NE(e.status().message().find(want), std::string::npos) << e.status() << " " << body;
  }
}

TEST(OpenAiResponse, ShapesPerEndpoint) {
  json c = ResponseJson(Endpoint::kCompletions, false, false, "id", "m", "AB", {65, 66}, "stop");
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "AB");
  json chat = ResponseJson(Endpoint::kChat, false, false, "id", "m", "AB", {65, 66}, "length");
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"], json({{"role", "assistant"}, {"content", "AB"}}));
  json first = ResponseJson(Endpoint::kChat, true, true, "id", "m", "A", {65}, nullptr);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], json({{"role", "assistant"}, {"content", "A"}}));
  json later = ResponseJson(Endpoint::kChat, true, false, "id", "m", "B", {66}, nullptr);
  EXPECT_FALSE(later["choices"][0]["delta"].contains("role"));
  json usage = UsageChunkJson(Endpoint::kChat, "id", "m", {{"total_tokens", 3}});
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 3);
  json models = ModelsJson("dsv4-tiny", 4096);
  EXPECT_EQ(models["data"][0]["id"], "dsv4-tiny");
}

// Feeds `text` byte by byte (plus a trailing EOS) and returns what comes out.
std::string FeedAll(StopMatcher& m, const std::string& text, bool* stopped) {
  std::string out;
  for (char ch : text) {
    const int32_t t = static_cast<unsigned char>(ch);
    for (int32_t r : m.Feed(t, std::string(1, ch))) out.push_back(static_cast<char>(r));
    if (m.stopped()) break;
  }
  *stopped = m.stopped();
  if (!m.stopped()) {
    for (int32_t r : m.Flush()) out.push_back(static_cast<char>(r));
  }
  return out;
}

TEST(StopMatcher, EndsBeforeTheFirstStopAndHoldsOnlyPossiblePrefixes) {
  bool stopped = false;
  StopMatcher none;
  EXPECT_EQ(FeedAll(none, "abc", &stopped), "abc");
  EXPECT_FALSE(stopped);
  StopMatcher m({"END", "XY"});
  EXPECT_EQ(FeedAll(m, "abENxENDzz", &stopped), "abENx");
  EXPECT_TRUE(stopped);
  StopMatcher two({"cd", "bcX"});
  EXPECT_EQ(FeedAll(two, "abcd", &stopped), "ab");  // "cd" completes first; "bc" was held back
  EXPECT_TRUE(stopped);
  StopMatcher tail({"END"});
  EXPECT_EQ(FeedAll(tail, "xxEN", &stopped), "xxEN");  // a held prefix comes out at the end
  EXPECT_FALSE(stopped);
  // Nothing is released that could still turn out to be part of a stop string.
  StopMatcher held({"abc"});
  EXPECT_TRUE(held.Feed('a', "a").empty());
  EXPECT_TRUE(held.Feed('b', "b").empty());
  EXPECT_EQ(held.Feed('x', "x"), (std::vector<int32_t>{'a', 'b', 'x'}));
  // Zero-byte tokens (EOS) ride along with the text around them.
  StopMatcher eos({"Z"});
  EXPECT_EQ(eos.Feed(257, ""), std::vector<int32_t>{257});
}

}  // namespace
}  // namespace dsv4::serve
