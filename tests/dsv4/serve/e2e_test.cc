// End to end: kvwire-dsv4 prefill, decode and router processes on loopback (tiny config,
// weights generated into a temporary folder), checked token for token against `kvwire-dsv4
// generate` in one process; the fault-injection switch proves the check sensitive; killed
// servers give the client clear HTTP errors and the survivors keep serving without leaking
// blocks.
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <thread>
#include <unistd.h>

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/process.h"
#include "tests/dsv4/serve/serve_cluster.h"
#include "tests/support/sanitizer_build.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;
using test_support::PromptOfTokens;

constexpr int kMaxTokens = 8;

// Lengths crossing the 128-token window and the 4- and 128-token compression boundaries.
const std::vector<int>& Lengths() {
  static const std::vector<int> v = {1, 5, 127, 129, 257, 300};
  return v;
}

using test_support::ServeCluster;
using test_support::ServeClusterOptions;

// Two threads a server; deadlines scaled in sanitizer builds; servers the tests kill on purpose
// pass at the end.
ServeClusterOptions E2eOptions() {
  return {.dir_tag = "e2e",
          .threads = 2,
          .peer_lease_ms = 2000 * test_support::kServerDeadlineScale,
          .request_timeout_s = 20 * test_support::kServerDeadlineScale,
          .router_timeout_s = 60 * test_support::kServerDeadlineScale,
          .servers_may_end_early = true};
}

// Waits until the server holds no blocks and no connector requests.
void ExpectDrained(const std::string& address, const std::string& what) {
  const absl::Time deadline = absl::Now() + absl::Seconds(40);
  json last;
  while (absl::Now() < deadline) {
    absl::StatusOr<json> h = GetJson(address, "/health");
    ASSERT_TRUE(h.ok()) << what << ": " << h.status();
    last = *h;
    if (last["used_blocks"] == 0 && last["live_connector_requests"] == 0 &&
        last["active_requests"] == 0) {
      return;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  FAIL() << what << " still holds blocks: " << last.dump();
}

// Waits until GET /health of `address` satisfies `pred`.
bool WaitHealth(const std::string& address, const std::function<bool(const json&)>& pred,
                absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    absl::StatusOr<json> h = GetJson(address, "/health");
    if (h.ok() && pred(*h)) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

// Greedy (the servers default to vLLM's temperature 1): every configuration the same tokens.
json Request(const std::string& prompt, bool stream, int max_tokens = kMaxTokens) {
  return {{"prompt", prompt}, {"max_tokens", max_tokens}, {"stream", stream}, {"temperature", 0}};
}

class DisaggregatedTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DisaggregatedTest, ReadAndWriteModesMatchGenerate) {
  const std::string transport = GetParam();
  ServeCluster c(E2eOptions());
  ASSERT_TRUE(c.MakeWeights().ok());
  std::vector<std::string> prompts;
  for (int n : Lengths()) prompts.push_back(PromptOfTokens(n));
  absl::StatusOr<std::vector<std::vector<int32_t>>> want = c.Reference(prompts, kMaxTokens);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<std::string> p = c.Serve("prefill", "prefill", transport);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> d = c.Serve("decode", "decode", transport);
  ASSERT_TRUE(d.ok()) << d.status();
  for (const char* mode : {"read", "write"}) {
    absl::StatusOr<std::string> r = c.Router(absl::StrCat("router-", mode), *p, *d, mode);
    ASSERT_TRUE(r.ok()) << r.status();
    for (size_t i = 0; i < prompts.size(); ++i) {
      SCOPED_TRACE(absl::StrCat(mode, " ", transport, " prompt of ", Lengths()[i], " tokens"));
      absl::StatusOr<CompletionResult> res =
          Complete(*r, Request(prompts[i], /*stream=*/i % 2 == 0), absl::Seconds(120));
      ASSERT_TRUE(res.ok()) << res.status() << c.Logs();
      ASSERT_EQ(res->status, 200) << res->error << c.Logs();
      EXPECT_EQ(res->tokens, (*want)[i]);
      const json& t = res->kvwire["transfer"];
      EXPECT_EQ(t.value("mode", ""), mode) << res->kvwire.dump();
      EXPECT_NE(t.value("transport", "").find(transport), std::string::npos) << t.dump();
      EXPECT_GT(t.value("bytes", 0), 0) << t.dump();
      EXPECT_GT(t.value("pages", 0), 0) << t.dump();
      EXPECT_FALSE(res->kvwire.value("corrupted_page", true));
    }
  }
  ExpectDrained(*p, "prefill");
  ExpectDrained(*d, "decode");
  // Metrics carry the connector's counters and the server's own.
  HttpCallOptions o;
  absl::StatusOr<HttpResponse> m = HttpCall(*d, "GET", "/metrics", "", o);
  ASSERT_TRUE(m.ok());
  EXPECT_NE(m->body.find("kvwire_connector_requests_total"), std::string::npos);
  EXPECT_NE(m->body.find("kvwire_dsv4_generated_tokens_total"), std::string::npos);
}

TEST_P(DisaggregatedTest, BadRequestsAreClear400sAndPlainRequestsServedWhole) {
  const std::string transport = GetParam();
  ServeCluster c(E2eOptions());
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> p = c.Serve("prefill", "prefill", transport);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> d = c.Serve("decode", "decode", transport);
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::string> r = c.Router("router", *p, *d, "read");
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<std::tuple<std::string, json, std::string>> cases = {
      {*r, {{"max_tokens", 3}}, "'prompt' is required"},
      {*r, {{"prompt", "x"}, {"max_tokens", -2}}, "'max_tokens'"},
      {*r, {{"prompt", std::string(5000, 'x')}}, "exceeds max_seq_len"},
      {*d, {{"prompt", "x"}, {"first_token", 3}}, "'first_token' is not supported"},
      {*r, {{"prompt", "x"}, {"best_of", 2}}, "'best_of' is not supported"},
      {*d,
       {{"prompt", "x"}, {"kv_transfer_params", {{"do_remote_prefill", true}}}},
       "kv_transfer_params"},
      {*p,
       {{"prompt", "x"}, {"kv_transfer_params", {{"do_remote_prefill", true}}}},
       "this is a prefill server"},
      {*d,
       {{"prompt", "x"},
        {"kv_transfer_params", {{"do_remote_prefill", true}, {"remote_host", "127.0.0.1"}}}},
       "kv_transfer_params"},
  };
  for (const auto& [address, body, want] : cases) {
    absl::StatusOr<CompletionResult> res = Complete(address, body, absl::Seconds(30));
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->status, 400) << body.dump() << " -> " << res->error;
    EXPECT_NE(res->error.find(want), std::string::npos) << res->error;
  }
  // A plain request (no kv_transfer_params) is served whole by the server it reaches.
  const std::string prompt = PromptOfTokens(129);
  absl::StatusOr<std::vector<std::vector<int32_t>>> want = c.Reference({prompt}, kMaxTokens);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<CompletionResult> local = Complete(*d, Request(prompt, true), absl::Seconds(60));
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_EQ(local->status, 200) << local->error;
  EXPECT_EQ(local->tokens, (*want)[0]);
  EXPECT_EQ(local->kvwire.value("role", ""), "local");
  ExpectDrained(*p, "prefill");
  ExpectDrained(*d, "decode");
}

INSTANTIATE_TEST_SUITE_P(Transports, DisaggregatedTest, ::testing::Values("tcp", "shm"));

// The comparison is sensitive: one corrupted received page changes the tokens.
TEST(FaultInjection, CorruptedKvPageMakesTheComparisonFail) {
  ServeCluster c(E2eOptions());
  ASSERT_TRUE(c.MakeWeights().ok());
  const std::vector<std::string> prompts = {
      "The decode server reads the KV cache of this prompt from the prefill server, one page "
      "of which is corrupted on arrival; the tokens that follow must show it.",
      PromptOfTokens(300)};
  absl::StatusOr<std::vector<std::vector<int32_t>>> want = c.Reference(prompts, kMaxTokens);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<std::string> p = c.Serve("prefill", "prefill", "tcp");
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> bad = c.Serve("decode-bad", "decode", "tcp", {"--corrupt-kv-page"});
  ASSERT_TRUE(bad.ok()) << bad.status();
  for (const char* mode : {"read", "write"}) {
    absl::StatusOr<std::string> r = c.Router(absl::StrCat("router-", mode), *p, *bad, mode);
    ASSERT_TRUE(r.ok()) << r.status();
    for (size_t i = 0; i < prompts.size(); ++i) {
      SCOPED_TRACE(absl::StrCat(mode, " prompt ", i));
      absl::StatusOr<CompletionResult> res =
          Complete(*r, Request(prompts[i], false), absl::Seconds(120));
      ASSERT_TRUE(res.ok()) << res.status();
      ASSERT_EQ(res->status, 200) << res->error;
      EXPECT_TRUE(res->kvwire.value("corrupted_page", false));
      ASSERT_EQ(res->tokens.size(), (*want)[i].size());
      EXPECT_NE(res->tokens, (*want)[i]) << "a corrupted KV page went unnoticed";
    }
  }
  ExpectDrained(*p, "prefill");
  ExpectDrained(*bad, "decode");
}

// Decode dies mid-request (SIGKILL while it generates): the client gets 502 with a JSON
// message; the other decode and the prefill keep serving and hold no blocks afterwards.
TEST(Failures, DecodeKilledMidRequest) {
  ServeCluster c(E2eOptions());
  ASSERT_TRUE(c.MakeWeights().ok());
  const std::string prompt = PromptOfTokens(140);
  absl::StatusOr<std::vector<std::vector<int32_t>>> want = c.Reference({prompt}, kMaxTokens);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<std::string> p = c.Serve("prefill", "prefill", "tcp");
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> d1 =
      c.Serve("decode1", "decode", "tcp", {"--inject-delay-ms", "100"});
  ASSERT_TRUE(d1.ok()) << d1.status();
  absl::StatusOr<std::string> d2 = c.Serve("decode2", "decode", "tcp");
  ASSERT_TRUE(d2.ok()) << d2.status();
  absl::StatusOr<std::string> r = c.Router("router", *p, absl::StrCat(*d1, ",", *d2), "read");
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<CompletionResult> res = absl::UnknownError("not run");
  std::thread client([&] { res = Complete(*r, Request(prompt, false, 200), absl::Seconds(120)); });
  // decode1 is generating: kill it.
  const bool busy = WaitHealth(*d1, [](const json& h) { return h["active_requests"] == 1; });
  c.process("decode1").Stop(SIGKILL);
  client.join();
  ASSERT_TRUE(busy) << c.Logs();
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->status, 502) << res->error;
  EXPECT_NE(res->error.find("decode server"), std::string::npos) << res->error;
  // The survivors serve (the dead decode is skipped) and the tokens still match.
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<CompletionResult> ok = Complete(*r, Request(prompt, true), absl::Seconds(120));
    ASSERT_TRUE(ok.ok()) << ok.status();
    ASSERT_EQ(ok->status, 200) << ok->error;
    EXPECT_EQ(ok->tokens, (*want)[0]);
  }
  ExpectDrained(*p, "prefill");
  ExpectDrained(*d2, "decode2");
}

// Prefill dies while it computes a write-mode request (decode has prepared its blocks): the
// client gets an HTTP error; decode gives the prepared blocks back; the other prefill serves.
TEST(Failures, PrefillKilledMidRequest) {
  ServeCluster c(E2eOptions());
  ASSERT_TRUE(c.MakeWeights().ok());
  const std::string prompt = PromptOfTokens(260);
  absl::StatusOr<std::vector<std::vector<int32_t>>> want = c.Reference({prompt}, kMaxTokens);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<std::string> p1 =
      c.Serve("prefill1", "prefill", "shm", {"--inject-delay-ms", "300"});
  ASSERT_TRUE(p1.ok()) << p1.status();
  absl::StatusOr<std::string> p2 = c.Serve("prefill2", "prefill", "shm");
  ASSERT_TRUE(p2.ok()) << p2.status();
  absl::StatusOr<std::string> d = c.Serve("decode", "decode", "shm");
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::string> r = c.Router("router", absl::StrCat(*p1, ",", *p2), *d, "write");
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<CompletionResult> res = absl::UnknownError("not run");
  std::thread client([&] { res = Complete(*r, Request(prompt, true), absl::Seconds(120)); });
  const bool busy = WaitHealth(*p1, [](const json& h) { return h["prefilling"] == 1; });
  c.process("prefill1").Stop(SIGKILL);
  client.join();
  ASSERT_TRUE(busy) << c.Logs();
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->status, 502) << res->error;
  EXPECT_NE(res->error.find("prefill server"), std::string::npos) << res->error;
  ExpectDrained(*d, "decode");
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<CompletionResult> ok = Complete(*r, Request(prompt, i == 0), absl::Seconds(120));
    ASSERT_TRUE(ok.ok()) << ok.status();
    ASSERT_EQ(ok->status, 200) << ok->error;
    EXPECT_EQ(ok->tokens, (*want)[0]);
  }
  ExpectDrained(*p2, "prefill2");
  ExpectDrained(*d, "decode");
}

#if KVWIRE_TEST_ASAN || KVWIRE_TEST_TSAN
// A real report of this build's sanitizer in a server (a data race under TSan, a heap overflow
// under ASan, committed as it exits: examples/dsv4/serve/planted_defect.h) makes it exit
// non-zero, and the check every test runs on its servers' ends fails. Only in sanitizer
// builds: elsewhere there is no report to plant.
TEST(ServerEnd, SanitizerReportInAServerFailsTheTest) {
  ServeCluster c(E2eOptions());
  ASSERT_TRUE(c.MakeWeights().ok());
  ASSERT_EQ(setenv("KVWIRE_DSV4_PLANT_SANITIZER_REPORT", "1", 1), 0);
  absl::StatusOr<std::string> p = c.Serve("planted", "prefill", "tcp");
  unsetenv("KVWIRE_DSV4_PLANT_SANITIZER_REPORT");
  ASSERT_TRUE(p.ok()) << p.status();
  // It serves normally until it is stopped.
  absl::StatusOr<json> h = GetJson(*p, "/health");
  ASSERT_TRUE(h.ok()) << h.status();
  std::unique_ptr<Process> planted = c.Take("planted");
  EXPECT_NONFATAL_FAILURE(ServeCluster::StopAndJudge("planted", *planted), "exited with status");
  const std::string log = planted->LogTail(20000);
  EXPECT_TRUE(log.find(KVWIRE_TEST_TSAN
                           ? "ThreadSanitizer: data race"
                           : "AddressSanitizer: heap-buffer-overflow") != std::string::npos)
      << log;
}
#endif

}  // namespace
}  // namespace dsv4::serve
