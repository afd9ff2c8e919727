// Admission control of the kvwire-dsv4 servers under load, against real processes on
// loopback: requests that do not fit the KV cache wait instead of failing (issue 18's read
// mode failure: "out of KV blocks" for a state slot at concurrency 16), a decode reserves its
// whole generation before it starts, an overloaded server answers 503 with Retry-After and
// the reason, and prefill's read-mode hand-offs expire (counted) when no reader comes.
#include <functional>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/http_client.h"
#include "tests/dsv4/serve/serve_cluster.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;
using test_support::PromptOfTokens;
using test_support::ServeCluster;

// Waits until GET /health of `address` satisfies `pred`; the last answer.
json WaitHealth(const std::string& address, const std::function<bool(const json&)>& pred,
                absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + timeout;
  json last;
  while (absl::Now() < deadline) {
    absl::StatusOr<json> h = GetJson(address, "/health");
    if (h.ok()) {
      last = *h;
      if (pred(last)) return last;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return last;
}

// The value of the first series of `body` whose line starts with `prefix`; -1 when none.
double Metric(const std::string& body, const std::string& prefix) {
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return -1;
}

bool Idle(const json& h) {
  return h.value("used_blocks", 1) == 0 && h.value("held_blocks", 1) == 0 &&
         h.value("live_connector_requests", 1) == 0 && h.value("active_requests", 1) == 0 &&
         h["admission"].value("queue_length", 1) == 0;
}

// Sends every request at once; the results in order.
std::vector<absl::StatusOr<CompletionResult>> AllAtOnce(const std::string& address,
                                                        const std::vector<json>& bodies) {
  std::vector<absl::StatusOr<CompletionResult>> out(bodies.size(), absl::UnknownError("not run"));
  std::vector<std::thread> ts;
  for (size_t i = 0; i < bodies.size(); ++i) {
    ts.emplace_back([&, i] { out[i] = Complete(address, bodies[i], absl::Seconds(180)); });
  }
  for (std::thread& t : ts) t.join();
  return out;
}

// Issue 18 in small: with two state slots per server, 16 concurrent read-mode requests
// through the router used to fail ("out of KV blocks: KV cache group
// 'c4a_compressor_state'"); now the ones that do not fit wait, and every one completes with
// generate's tokens.
TEST(Admission, RequestsThatDoNotFitWaitInsteadOfFailing) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  std::vector<std::string> prompts;
  std::vector<json> bodies;
  for (int i = 0; i < 16; ++i) {
    prompts.push_back(PromptOfTokens(6 + (i * 37) % 595));
    bodies.push_back({{"prompt", prompts.back()},
                      {"max_tokens", 8},
                      {"temperature", 0},
                      {"stream", i % 2 == 0}});
  }
  absl::StatusOr<std::vector<std::vector<int32_t>>> want = c.Reference(prompts, 8);
  ASSERT_TRUE(want.ok()) << want.status();
  const std::vector<std::string> small = {
      "--max-requests",      "2",
      "--max-queue-wait-s",  absl::StrCat(30 * test_support::kServerDeadlineScale),
      "--request-timeout-s", absl::StrCat(60 * test_support::kServerDeadlineScale)};
  absl::StatusOr<std::string> p = c.Serve("prefill", "prefill", "shm", small);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> d = c.Serve("decode", "decode", "shm", small);
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::string> r = c.Router("router", *p, *d, "read");
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<absl::StatusOr<CompletionResult>> res = AllAtOnce(*r, bodies);
  for (size_t i = 0; i < res.size(); ++i) {
    ASSERT_TRUE(res[i].ok()) << i << ": " << res[i].status();
    ASSERT_EQ(res[i]->status, 200) << i << ": " << res[i]->error << c.Logs();
    EXPECT_TRUE(res[i]->error.empty()) << i << ": " << res[i]->error;
    EXPECT_EQ(res[i]->tokens, (*want)[i]) << i;
  }
  for (const std::string& a : {*p, *d}) {
    const json h = WaitHealth(a, Idle);
    EXPECT_TRUE(Idle(h)) << h.dump();
    for (const auto& [why, n] : h["admission"]["rejected"].items()) EXPECT_EQ(n, 0) << why;
    // Prefill's two slots were held for the readers: later prompts waited for them (decode,
    // fed one prefill at a time, need not have waited).
    if (a == *p) EXPECT_GT(h["admission"].value("waited", 0), 0) << h.dump();
  }
}

// A decode reserves prompt + max_tokens before it starts: two generations that can only
// grow one at a time run one after the other, and neither fails half way for a block.
TEST(Admission, DecodeReservesItsWholeGenerationBeforeItStarts) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  // 100 prompt tokens + 150 generated: 4 of the 64-token blocks each, 8 > 6 together; the
  // prompts alone (2 blocks each) would fit side by side.
  const std::vector<std::string> prompts = {PromptOfTokens(100), PromptOfTokens(101)};
  absl::StatusOr<std::vector<std::vector<int32_t>>> want = c.Reference(prompts, 150);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<std::string> p = c.Serve("prefill", "prefill", "tcp");
  ASSERT_TRUE(p.ok()) << p.status();
  // 20 ms per decode step (3 s per generation), so the second request always arrives while
  // the first still generates and must wait for it: without the delay, on a loaded machine
  // the first could finish before the second reached the decode, and nothing waited.
  absl::StatusOr<std::string> d =
      c.Serve("decode", "decode", "tcp", {"--num-blocks", "6", "--inject-delay-ms", "20"});
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::string> r = c.Router("router", *p, *d, "read");
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<json> bodies;
  for (size_t i = 0; i < prompts.size(); ++i) {
    bodies.push_back(
        {{"prompt", prompts[i]}, {"max_tokens", 150}, {"temperature", 0}, {"stream", i == 0}});
  }
  std::vector<absl::StatusOr<CompletionResult>> res = AllAtOnce(*r, bodies);
  for (size_t i = 0; i < res.size(); ++i) {
    ASSERT_TRUE(res[i].ok()) << res[i].status();
    ASSERT_EQ(res[i]->status, 200) << res[i]->error << c.Logs();
    EXPECT_TRUE(res[i]->error.empty()) << res[i]->error;
    EXPECT_EQ(res[i]->tokens, (*want)[i]);
  }
  const json h = WaitHealth(*d, Idle);
  EXPECT_TRUE(Idle(h)) << h.dump();
  EXPECT_EQ(h["admission"].value("waited", 0), 1) << h.dump();
  EXPECT_TRUE(Idle(WaitHealth(*p, Idle)));

  // More than the whole cache never fits: refused at once, naming the group and the flag.
  absl::StatusOr<std::string> both = c.Serve("both", "both", "tcp", {"--num-blocks", "6"});
  ASSERT_TRUE(both.ok()) << both.status();
  absl::StatusOr<CompletionResult> huge =
      Complete(*both, {{"prompt", PromptOfTokens(300)}, {"max_tokens", 200}}, absl::Seconds(30));
  ASSERT_TRUE(huge.ok()) << huge.status();
  EXPECT_EQ(huge->status, 400);
  EXPECT_NE(huge->error.find("group 'swa_kv': 8 needed, 6 available"), std::string::npos)
      << huge->error;
  EXPECT_NE(huge->error.find("--num-blocks"), std::string::npos) << huge->error;
}

// One slot, a queue of one, a wait of one second: the third request is refused at once
// (queue full), the second once its second has passed (deadline, with the group it lacked);
// both with 503 and Retry-After; the first completes; the metrics count both reasons.
TEST(Admission, OverloadIsA503WithRetryAfterThatNamesTheReason) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> s = c.Serve("both", "both", "tcp",
                                          {"--max-requests", "1", "--max-queue", "1",
                                           "--max-queue-wait-s", "1", "--inject-delay-ms", "100"});
  ASSERT_TRUE(s.ok()) << s.status();
  const json first = {
      {"prompt", "the first request holds the only slot"}, {"max_tokens", 40}, {"temperature", 0}};
  absl::StatusOr<CompletionResult> a = absl::UnknownError("not run");
  std::thread ta([&] { a = Complete(*s, first, absl::Seconds(120)); });
  EXPECT_EQ(WaitHealth(*s, [](const json& h) { return h["active_requests"] == 1; })
                .value("active_requests", 0),
            1);
  const std::string body = json{{"prompt", "later"}, {"max_tokens", 4}, {"temperature", 0}}.dump();
  absl::StatusOr<HttpResponse> b = absl::UnknownError("not run");
  std::thread tb([&] { b = HttpCall(*s, "POST", "/v1/completions", body); });
  EXPECT_EQ(WaitHealth(*s, [](const json& h) { return h["admission"]["queue_length"] == 1; })
                .value("admission", json::object())
                .value("queue_length", 0),
            1);
  absl::StatusOr<HttpResponse> full = HttpCall(*s, "POST", "/v1/completions", body);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->status, 503) << full->body;
  EXPECT_EQ(full->retry_after, "1");
  EXPECT_NE(full->body.find("admission queue is full (1 requests wait"), std::string::npos)
      << full->body;
  tb.join();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->status, 503) << b->body;
  EXPECT_EQ(b->retry_after, "1");
  EXPECT_NE(b->body.find("for KV blocks (group '"), std::string::npos) << b->body;
  EXPECT_NE(b->body.find("compressor_state': 1 needed, 0 available"), std::string::npos) << b->body;
  EXPECT_NE(b->body.find("--max-queue-wait-s"), std::string::npos) << b->body;
  ta.join();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->status, 200) << a->error;
  EXPECT_EQ(a->tokens.size(), 40u);
  HttpCallOptions o;
  absl::StatusOr<HttpResponse> m = HttpCall(*s, "GET", "/metrics", "", o);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string rejected = "kvwire_dsv4_admission_rejected_total{engine=\"";
  size_t at = m->body.find(rejected);
  ASSERT_NE(at, std::string::npos) << m->body;
  const std::string engine = m->body.substr(
      at + rejected.size(), m->body.find('"', at + rejected.size()) - at - rejected.size());
  const std::string e = absl::StrCat("{engine=\"", engine, "\"");
  EXPECT_EQ(Metric(m->body, absl::StrCat("kvwire_dsv4_admission_rejected_total", e,
                                         ",reason=\"queue_full\"}")),
            1)
      << m->body;
  EXPECT_EQ(Metric(m->body, absl::StrCat("kvwire_dsv4_admission_rejected_total", e,
                                         ",reason=\"wait_deadline\"}")),
            1)
      << m->body;
  EXPECT_EQ(Metric(m->body, absl::StrCat("kvwire_dsv4_admission_queue_length", e, "}")), 0);
  // The first request was admitted at once, the later ones were refused: one admission.
  EXPECT_EQ(Metric(m->body, absl::StrCat("kvwire_dsv4_admission_wait_seconds_count", e, "}")), 1);
  EXPECT_TRUE(Idle(WaitHealth(*s, Idle)));
}

// Prefill holds a read-mode hand-off's blocks for its reader only for --request-timeout-s:
// nobody reads, the lease expires, the blocks come back, and the expiry is counted.
TEST(Hold, ReadModeHandOffWithoutAReaderExpiresAndIsCounted) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> p =
      c.Serve("prefill", "prefill", "tcp", {"--request-timeout-s", "2"});
  ASSERT_TRUE(p.ok()) << p.status();
  const json body = {{"prompt", PromptOfTokens(200)},
                     {"max_tokens", 1},
                     {"kv_transfer_params", {{"do_remote_decode", true}, {"mode", "read"}}}};
  absl::StatusOr<CompletionResult> r = Complete(*p, body, absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->status, 200) << r->error;
  absl::StatusOr<json> held = GetJson(*p, "/health");
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ((*held)["held_requests"], 1) << held->dump();
  EXPECT_GT((*held)["held_blocks"].get<int>(), 0) << held->dump();
  const json h = WaitHealth(*p, Idle, absl::Seconds(20));
  EXPECT_TRUE(Idle(h)) << h.dump();
  EXPECT_EQ(h["connector"].value("lease_expired", 0), 1) << h.dump();
  HttpCallOptions o;
  absl::StatusOr<HttpResponse> m = HttpCall(*p, "GET", "/metrics", "", o);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Metric(m->body, "kvwire_connector_lease_expired_total{"), 1) << m->body;
  EXPECT_EQ(Metric(m->body, "kvwire_dsv4_held_blocks{"), 0) << m->body;
}

}  // namespace
}  // namespace dsv4::serve
