// vLLM's request surface against real kvwire-dsv4 processes (tiny config, loopback):
// ignore_eos and min_tokens past a sampled EOS, min_tokens against stop strings, logprobs that
// sum to one in both endpoints' shapes, echo; seeded sampling with every filter and penalty
// equal token for token through read- and write-mode routers over tcp and shm and through the
// toy proxy's protocol, against the aggregated server (and two unseeded runs differ); and a
// decode that refuses a request carrying a prefill's hand-off (bad parameter, unknown model,
// overload, an admission deadline, a request larger than its cache, n > 1) frees the prefill's
// blocks at once.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/sse.h"
#include "tests/dsv4/serve/serve_cluster.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;
using test_support::PromptOfTokens;
using test_support::ServeCluster;

constexpr int32_t kEos = 257;

struct Answer {
  int status = 0;
  json body;  // the parsed body (null when it is not JSON)
  std::string raw;
};

Answer Post(const std::string& address, const std::string& path, const json& request) {
  HttpCallOptions o;
  o.deadline = absl::Now() + absl::Seconds(120);
  absl::StatusOr<HttpResponse> r = HttpCall(address, "POST", path, request.dump(), o);
  EXPECT_TRUE(r.ok()) << r.status();
  Answer a;
  if (!r.ok()) return a;
  a.status = r->status;
  a.raw = r->body;
  a.body = json::parse(r->body, nullptr, false);
  if (a.body.is_discarded()) a.body = nullptr;
  return a;
}

// The token ids of a 200 completion's first choice.
std::vector<int32_t> Tokens(const Answer& a) {
  EXPECT_EQ(a.status, 200) << a.raw;
  if (a.status != 200) return {};
  return a.body["choices"][0]["token_ids"].get<std::vector<int32_t>>();
}

std::string FinishReason(const Answer& a) {
  const json& r = a.body["choices"][0]["finish_reason"];
  return r.is_string() ? r.get<std::string>() : "";
}

// A streamed answer's token ids per choice index, and its usage chunk's usage.
struct Streamed {
  std::map<int, std::vector<int32_t>> tokens;
  std::set<std::string> ids;  // of the chunks
  json usage;
  bool done = false;
};

Streamed Stream(const std::string& address, const json& request) {
  HttpCallOptions o;
  o.deadline = absl::Now() + absl::Seconds(120);
  absl::StatusOr<HttpResponse> r = HttpCall(address, "POST", "/v1/completions", request.dump(), o);
  Streamed out;
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return out;
  EXPECT_EQ(r->status, 200) << r->body;
  SseParser parser;
  for (const std::string& event : parser.Feed(r->body)) {
    if (event == "[DONE]") {
      out.done = true;
      continue;
    }
    const json j = json::parse(event, nullptr, false);
    EXPECT_FALSE(j.is_discarded() || j.contains("error")) << event;
    if (j.is_discarded()) continue;
    if (j.contains("usage")) out.usage = j["usage"];
    if (j.contains("id")) out.ids.insert(j["id"].get<std::string>());
    for (const json& c : j.value("choices", json::array())) {
      std::vector<int32_t>& t = out.tokens[c["index"].get<int>()];
      for (const json& id : c["token_ids"]) t.push_back(id.get<int32_t>());
    }
  }
  return out;
}

// n choices: choice i is the one-choice request with seed + i, in both shapes; the usage
// sums them.
void ExpectChoices(const std::string& address, const std::string& reference) {
  const json req = {{"prompt", "Once"},   {"max_tokens", 6}, {"temperature", 1.0},
                    {"ignore_eos", true}, {"seed", 70},      {"n", 3}};
  const Answer a = Post(address, "/v1/completions", req);
  ASSERT_EQ(a.status, 200) << a.raw;
  ASSERT_EQ(a.body["choices"].size(), 3u) << a.raw;
  json one = req;
  one.erase("n");
  std::set<std::vector<int32_t>> distinct;
  for (int i = 0; i < 3; ++i) {
    const json& c = a.body["choices"][i];
    EXPECT_EQ(c["index"], i);
    one["seed"] = 70 + i;
    const std::vector<int32_t> want = Tokens(Post(reference, "/v1/completions", one));
    EXPECT_EQ(c["token_ids"].get<std::vector<int32_t>>(), want) << "choice " << i;
    distinct.insert(want);
  }
  EXPECT_EQ(distinct.size(), 3u) << "each choice draws its own tokens";
  EXPECT_EQ(a.body["usage"]["completion_tokens"], 18);
  json streamed = req;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  const Streamed s = Stream(address, streamed);
  EXPECT_TRUE(s.done);
  ASSERT_EQ(s.tokens.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s.tokens.at(i), a.body["choices"][i]["token_ids"].get<std::vector<int32_t>>());
  }
  EXPECT_EQ(s.usage["completion_tokens"], 18);
  EXPECT_EQ(s.ids.size(), 1u) << "one completion, one id";
}

json Health(const std::string& address) {
  absl::StatusOr<json> h = GetJson(address, "/health");
  return h.ok() ? *h : json();
}

// ignore_eos: exactly max_tokens tokens past a sampled EOS, the tokens up to it the same;
// min_tokens: no EOS before it.
TEST(Surface, IgnoreEosAndMinTokensPastASampledEos) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> s = c.Serve("both", "both", "tcp");
  ASSERT_TRUE(s.ok()) << s.status();
  constexpr int kMax = 64;
  // A seed whose sampled output ends with EOS (at vLLM's highest temperature, about one in
  // six seeds ends within 64 tokens on the tiny model).
  json req = {{"prompt", "Once"}, {"max_tokens", kMax}, {"temperature", 2.0}};
  std::vector<int32_t> base;
  for (int seed = 1; seed <= 200 && (base.empty() || base.back() != kEos); ++seed) {
    req["seed"] = seed;
    const Answer a = Post(*s, "/v1/completions", req);
    base = Tokens(a);
    ASSERT_FALSE(base.empty());
    if (base.back() == kEos) {
      EXPECT_EQ(FinishReason(a), "stop");
    }
  }
  ASSERT_EQ(base.back(), kEos) << "no seed in 200 sampled an EOS";
  const size_t k = base.size();
  ASSERT_LT(k, static_cast<size_t>(kMax));

  json ignore = req;
  ignore["ignore_eos"] = true;
  const Answer all = Post(*s, "/v1/completions", ignore);
  const std::vector<int32_t> got = Tokens(all);
  ASSERT_EQ(got.size(), static_cast<size_t>(kMax)) << "ignore_eos runs to max_tokens";
  EXPECT_EQ(FinishReason(all), "length");
  EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + k), base) << "EOS included";
  EXPECT_EQ(all.body["usage"]["completion_tokens"], kMax);

  json min = req;
  min["min_tokens"] = k + 2;
  const std::vector<int32_t> held = Tokens(Post(*s, "/v1/completions", min));
  ASSERT_GE(held.size(), k + 2);
  for (size_t i = 0; i < k + 2; ++i) EXPECT_NE(held[i], kEos) << "EOS at " << i;
}

// A stop string met early ends the output; with min_tokens it does not before then.
TEST(Surface, MinTokensSuppressesStopStringsBeforeIt) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> s = c.Serve("both", "both", "tcp");
  ASSERT_TRUE(s.ok()) << s.status();
  constexpr int kMax = 16;
  // Greedy: the same tokens every time; the stop string is an early ASCII token's byte.
  std::vector<int32_t> base;
  std::string stop;
  size_t at = 0;
  for (int len = 3; len < 40 && stop.empty(); ++len) {
    json req = {{"prompt", PromptOfTokens(len)},
                {"max_tokens", kMax},
                {"temperature", 0},
                {"ignore_eos", true}};
    base = Tokens(Post(*s, "/v1/completions", req));
    ASSERT_EQ(base.size(), static_cast<size_t>(kMax));
    // min_tokens masks EOS: a greedy output with an early EOS would change under it.
    if (std::find(base.begin(), base.begin() + 12, kEos) != base.begin() + 12) continue;
    for (at = 0; at < 4; ++at) {
      if (base[at] > 0 && base[at] < 128) {
        stop = std::string(1, static_cast<char>(base[at]));
        break;
      }
    }
    if (!stop.empty()) {
      json with_stop = req;
      with_stop["stop"] = stop;
      const Answer a = Post(*s, "/v1/completions", with_stop);
      EXPECT_EQ(FinishReason(a), "stop");
      EXPECT_EQ(Tokens(a), std::vector<int32_t>(base.begin(), base.begin() + at));
      with_stop["min_tokens"] = 12;
      const Answer held = Post(*s, "/v1/completions", with_stop);
      const std::vector<int32_t> got = Tokens(held);
      ASSERT_GE(got.size(), 12u) << held.raw;
      EXPECT_EQ(got, std::vector<int32_t>(base.begin(), base.begin() + got.size()));
    }
  }
  ASSERT_FALSE(stop.empty()) << "no prompt gave an early ASCII token";
}

double SumExp(const json& values) {
  double sum = 0;
  for (const json& v : values) sum += std::exp(v.get<double>());
  return sum;
}

TEST(Surface, LogprobsSumToOneAndEcho) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> s = c.Serve("both", "both", "tcp", {"--max-logprobs", "258"});
  ASSERT_TRUE(s.ok()) << s.status();
  // Completions, every token of the vocabulary (-1), keyed by id so none collide.
  const Answer a = Post(*s, "/v1/completions",
                        {{"prompt", "Hello"},
                         {"max_tokens", 4},
                         {"temperature", 0},
                         {"logprobs", -1},
                         {"return_tokens_as_token_ids", true}});
  ASSERT_EQ(a.status, 200) << a.raw;
  const json& lp = a.body["choices"][0]["logprobs"];
  const std::vector<int32_t> tokens = Tokens(a);
  ASSERT_EQ(lp["top_logprobs"].size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const json& top = lp["top_logprobs"][i];
    ASSERT_EQ(top.size(), 258u);
    json values = json::array();
    double best = -1e9;
    std::string best_key;
    for (const auto& [key, v] : top.items()) {
      values.push_back(v);
      if (v.get<double>() > best) best = v.get<double>(), best_key = key;
    }
    EXPECT_NEAR(SumExp(values), 1.0, 1e-4) << i;
    const std::string key = absl::StrCat("token_id:", tokens[i]);
    EXPECT_EQ(lp["tokens"][i], key);
    EXPECT_EQ(best_key, key) << "greedy draws the most likely token";
    EXPECT_DOUBLE_EQ(lp["token_logprobs"][i].get<double>(), top[key].get<double>());
  }
  EXPECT_EQ(lp["text_offset"][0], 0);
  // Chat: logprobs + top_logprobs (-1: all), a list per token.
  const Answer chat = Post(*s, "/v1/chat/completions",
                           {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                            {"max_completion_tokens", 3},
                            {"temperature", 0},
                            {"logprobs", true},
                            {"top_logprobs", -1}});
  ASSERT_EQ(chat.status, 200) << chat.raw;
  const json& content = chat.body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 3u);
  for (const json& t : content) {
    json values = json::array();
    for (const json& e : t["top_logprobs"]) values.push_back(e["logprob"]);
    ASSERT_EQ(values.size(), 258u);
    EXPECT_NEAR(SumExp(values), 1.0, 1e-4);
    EXPECT_EQ(t["logprob"], t["top_logprobs"][0]["logprob"]) << "greedy: the top token";
  }
  // A few: the sampled token and the top ones; past the server's bound: a 400 naming it.
  const Answer two = Post(
      *s, "/v1/completions",
      {{"prompt", "Hello"}, {"max_tokens", 2}, {"logprobs", 2}, {"temperature", 1.0}, {"seed", 5}});
  ASSERT_EQ(two.status, 200) << two.raw;
  for (const json& top : two.body["choices"][0]["logprobs"]["top_logprobs"]) {
    EXPECT_GE(top.size(), 2u);
    EXPECT_LE(top.size(), 3u);
  }
  const Answer over = Post(*s, "/v1/completions", {{"prompt", "Hello"}, {"logprobs", 259}});
  EXPECT_EQ(over.status, 400);
  EXPECT_TRUE(absl::StrContains(over.raw, "'logprobs'")) << over.raw;
  // echo: the prompt, then the completion (its tokens alone in token_ids).
  const Answer plain =
      Post(*s, "/v1/completions", {{"prompt", "Hello"}, {"max_tokens", 3}, {"temperature", 0}});
  const Answer echo =
      Post(*s, "/v1/completions",
           {{"prompt", "Hello"}, {"max_tokens", 3}, {"temperature", 0}, {"echo", true}});
  ASSERT_EQ(echo.status, 200) << echo.raw;
  EXPECT_EQ(echo.body["choices"][0]["text"].get<std::string>(),
            "Hello" + plain.body["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(Tokens(echo), Tokens(plain));
  absl::StatusOr<CompletionResult> streamed = Complete(*s,
                                                       {{"prompt", "Hello"},
                                                        {"max_tokens", 3},
                                                        {"temperature", 0},
                                                        {"echo", true},
                                                        {"stream", true}},
                                                       absl::Seconds(60));
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->text, echo.body["choices"][0]["text"].get<std::string>());
}

// Every filter and penalty at once, seeded: the same tokens (and logprobs) from the aggregated
// server, the read- and write-mode routers over tcp and shm, and the toy proxy's protocol.
TEST(SeededSampling, EqualAcrossPdAndDifferentWithoutASeed) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> both = c.Serve("both", "both", "tcp");
  ASSERT_TRUE(both.ok()) << both.status();
  std::vector<std::string> via;
  std::string tcp_prefill, tcp_decode;
  for (const std::string t : {"tcp", "shm"}) {
    absl::StatusOr<std::string> p = c.Serve("prefill-" + t, "prefill", t);
    ASSERT_TRUE(p.ok()) << p.status();
    absl::StatusOr<std::string> d = c.Serve("decode-" + t, "decode", t);
    ASSERT_TRUE(d.ok()) << d.status();
    if (t == "tcp") tcp_prefill = *p, tcp_decode = *d;
    for (const std::string mode : {"read", "write"}) {
      absl::StatusOr<std::string> r = c.Router("router-" + t + "-" + mode, *p, *d, mode);
      ASSERT_TRUE(r.ok()) << r.status();
      via.push_back(*r);
    }
  }
  for (int len : {5, 129}) {
    const json req = {{"prompt", PromptOfTokens(len)},
                      {"max_tokens", 12},
                      {"temperature", 0.9},
                      {"top_p", 0.95},
                      {"top_k", 100},
                      {"min_p", 0.01},
                      {"presence_penalty", 0.3},
                      {"frequency_penalty", 0.2},
                      {"repetition_penalty", 1.1},
                      {"ignore_eos", true},
                      {"logprobs", 1},
                      {"seed", 1234 + len}};
    const Answer want = Post(*both, "/v1/completions", req);
    const std::vector<int32_t> tokens = Tokens(want);
    ASSERT_EQ(tokens.size(), 12u);
    const json& want_lp = want.body["choices"][0]["logprobs"]["token_logprobs"];
    for (const std::string& r : via) {
      const Answer got = Post(r, "/v1/completions", req);
      EXPECT_EQ(Tokens(got), tokens) << "via " << r << " prompt " << len;
      const json& lp = got.body["choices"][0]["logprobs"]["token_logprobs"];
      ASSERT_EQ(lp.size(), want_lp.size()) << got.raw;
      for (size_t i = 0; i < lp.size(); ++i) {
        EXPECT_NEAR(lp[i].get<double>(), want_lp[i].get<double>(), 1e-4) << i;
      }
      json streamed = req;
      streamed["stream"] = true;
      absl::StatusOr<CompletionResult> sr = Complete(r, streamed, absl::Seconds(120));
      ASSERT_TRUE(sr.ok()) << sr.status();
      EXPECT_EQ(sr->tokens, tokens) << "streamed via " << r;
    }
    // vLLM's toy proxy: the request to prefill with max_tokens 1 and do_remote_decode, then
    // the original to decode with prefill's kv_transfer_params.
    json to_prefill = req;
    to_prefill["max_tokens"] = 1;
    to_prefill["kv_transfer_params"] = {{"do_remote_decode", true}};
    const Answer pa = Post(tcp_prefill, "/v1/completions", to_prefill);
    ASSERT_EQ(pa.status, 200) << pa.raw;
    json to_decode = req;
    to_decode["kv_transfer_params"] = pa.body["kv_transfer_params"];
    EXPECT_EQ(Tokens(Post(tcp_decode, "/v1/completions", to_decode)), tokens) << "toy proxy";
  }
  ExpectChoices(*both, *both);
  ExpectChoices(via[0], *both);
  // No seed: each request draws its own.
  const json unseeded = {
      {"prompt", "Once"}, {"max_tokens", 16}, {"temperature", 1.5}, {"ignore_eos", true}};
  EXPECT_NE(Tokens(Post(*both, "/v1/completions", unseeded)),
            Tokens(Post(*both, "/v1/completions", unseeded)));
  EXPECT_NE(Tokens(Post(via[0], "/v1/completions", unseeded)),
            Tokens(Post(via[0], "/v1/completions", unseeded)));
}

// The toy proxy's shape: prefill accepts the request (max_tokens 1), decode refuses it. The
// decode tells the prefill to free the blocks it holds: far sooner than their lease (60 s).
TEST(HandOff, DecodeRefusalReleasesThePrefillsBlocks) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> p =
      c.Serve("prefill", "prefill", "tcp", {"--request-timeout-s", "60"});
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> d = c.Serve("decode", "decode", "tcp", {"--num-blocks", "20"});
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::string> busy = c.Serve("busy", "decode", "tcp", {"--max-queue", "0"});
  ASSERT_TRUE(busy.ok()) << busy.status();
  // One request at a time, each generated token 40 ms: a second one waits 1 s, then is refused.
  absl::StatusOr<std::string> slow =
      c.Serve("slow", "decode", "tcp",
              {"--max-requests", "1", "--max-queue-wait-s", "1", "--inject-delay-ms", "40"});
  ASSERT_TRUE(slow.ok()) << slow.status();
  struct Case {
    const char* name;
    std::string decode;
    json change;  // to the decode's request
    int status;
    const char* names;  // in the decode's error
  };
  const std::vector<Case> cases = {
      {"bad parameter", *d, {{"min_tokens", 5}}, 400, "'min_tokens'"},
      {"unknown model", *d, {{"model", "other"}}, 404, "other"},
      {"larger than the cache", *d, {{"max_tokens", 2000}}, 400, "whole cache"},
      {"overload", *busy, json::object(), 503, "overloaded"},
      {"n > 1", *d, {{"n", 2}, {"temperature", 1.0}}, 400, "'n'"},
      {"admission deadline", *slow, json::object(), 503, "--max-queue-wait-s"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const json req = {{"prompt", PromptOfTokens(100)}, {"max_tokens", 2}, {"min_tokens", 0}};
    json to_prefill = req;
    to_prefill.update(k.change);
    to_prefill.erase("model");
    to_prefill["max_tokens"] = 1;
    to_prefill["kv_transfer_params"] = {{"do_remote_decode", true}};
    const Answer pa = Post(*p, "/v1/completions", to_prefill);
    ASSERT_EQ(pa.status, 200) << pa.raw;
    ASSERT_GT(Health(*p).value("held_blocks", 0), 0) << "the hand-off holds blocks";
    json to_decode = req;
    to_decode.update(k.change);
    to_decode["kv_transfer_params"] = pa.body["kv_transfer_params"];
    std::thread occupant;  // the slow decode's one request slot, taken for 4 s
    if (k.decode == *slow) {
      occupant = std::thread([&] {
        absl::StatusOr<CompletionResult> r =
            Complete(*slow, {{"prompt", "x"}, {"max_tokens", 100}, {"ignore_eos", true}},
                     absl::Seconds(120));
        EXPECT_TRUE(r.ok() && r->status == 200) << (r.ok() ? r->error : r.status().ToString());
      });
      const absl::Time until = absl::Now() + absl::Seconds(30);
      while (Health(*slow).value("active_requests", 0) == 0 && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    const Answer da = Post(k.decode, "/v1/completions", to_decode);
    const absl::Time refused = absl::Now();
    EXPECT_EQ(da.status, k.status) << da.raw;
    EXPECT_TRUE(absl::StrContains(da.raw, k.names)) << da.raw;
    // Deadline: far below the 60 s lease (the issue asks for 1 s; the time is printed, not
    // asserted, on two loaded cores).
    json h;
    while (absl::Now() - refused < absl::Seconds(20)) {
      h = Health(*p);
      if (h.value("held_blocks", 1) == 0 && h.value("used_blocks", 1) == 0) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(h.value("held_blocks", 1), 0) << h.dump() << c.Logs();
    EXPECT_EQ(h.value("used_blocks", 1), 0) << h.dump();
    std::printf("%s: prefill's blocks free %.0f ms after the decode's refusal\n", k.name,
                absl::ToDoubleMilliseconds(absl::Now() - refused));
    if (occupant.joinable()) occupant.join();
  }
  // Released by their reader, every one; none waited for the lease (60 s).
  const json h = Health(*p);
  EXPECT_EQ(h["connector"].value("released", 0), static_cast<int>(cases.size())) << h.dump();
  EXPECT_EQ(h["connector"].value("lease_expired", 1), 0) << h.dump();
}

}  // namespace
}  // namespace dsv4::serve
