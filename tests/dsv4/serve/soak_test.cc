// Soak: many completions at once through the router, in read and write mode, over one
// transport per test (tcp, shm), against real kvwire-dsv4 processes on loopback with their
// default capacity flags: one prefill, two decodes, a read-mode and a write-mode router, and
// an aggregated ("both") server whose tokens are the reference.
//
// Faults the test injects, and only those, may fail a request:
//   - a share of streamed requests is dropped by the client after the first token;
//   - a share of requests is aborted by the client (it gives up after a few milliseconds);
//   - one decode is killed (SIGKILL) a third of the way through and started again on its
//     port: requests in flight at that moment whose error names that decode (its address,
//     engine id or kv address) may fail; an error naming another instance is unexpected.
// Every other request must complete with exactly the aggregated server's tokens. At the end
// every instance holds no block (used or held for a reader), nothing waits, and the engine's
// and the connector's counters balance (transfers started = ended). The result is printed.
//
// Bounded in count and time: KVWIRE_SOAK_REQUESTS requests per transport (CI's short form:
// 40), KVWIRE_SOAK_CONCURRENCY clients (32), KVWIRE_SOAK_SECONDS for the whole load (300);
// `make soak` runs the long form.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/process.h"
#include "examples/dsv4/serve/sse.h"
#include "tests/dsv4/serve/serve_cluster.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;

constexpr int kMaxTokens = 8;
// Servers' lease on read-mode hand-offs and deadline of a load (and of a write-mode
// prepare, which waits while prefill's queue and compute do): what a reader that died costs
// at most before its blocks come back. Longer than prefill's waits at this load (10 s seen at
// concurrency 32 on a loaded 2-core machine): a shorter one fails write-mode requests whose
// decode gave up on its prepared blocks.
constexpr int kRequestTimeoutS = 30 * test_support::kServerDeadlineScale;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  int64_t out = 0;
  if (v == nullptr || !absl::SimpleAtoi(v, &out) || out <= 0) return fallback;
  return out;
}

enum class Fault { kNone, kDisconnect, kAbort };

struct Planned {
  size_t prompt = 0;
  bool write = false;
  bool stream = false;
  Fault fault = Fault::kNone;
  int abort_ms = 0;
};

struct Done {
  enum Outcome { kOk, kDisconnected, kAborted, kKilled, kUnexpected } outcome = kUnexpected;
  double ms = 0;
  std::string detail;
};

// Random prompts of 5-600 bytes (letters, spaces and punctuation).
std::vector<std::string> Prompts(std::mt19937& rng, size_t n) {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,;0123456789";
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) {
    const int len = std::uniform_int_distribution<int>(5, 600)(rng);
    std::string s;
    for (int k = 0; k < len; ++k) s += kChars[rng() % (sizeof(kChars) - 1)];
    out.push_back(std::move(s));
  }
  return out;
}

// A streamed request the client drops once the first token has arrived.
Done Disconnect(const std::string& router, const json& body) {
  Done d;
  SseParser sse;
  bool got_token = false;
  std::string seen;  // what came instead of a token (an error answer or event)
  HttpCallOptions o;
  o.deadline = absl::Now() + absl::Seconds(120 * test_support::kServerDeadlineScale);
  o.on_body = [&](std::string_view piece) {
    if (seen.size() < 1000) seen.append(piece.substr(0, 1000));
    for (const std::string& e : sse.Feed(piece)) {
      if (e.find("\"token_ids\":[") != std::string::npos) got_token = true;
    }
    return !got_token;
  };
  absl::StatusOr<HttpResponse> r = HttpCall(router, "POST", "/v1/completions", body.dump(), o);
  if (!r.ok() && absl::IsCancelled(r.status())) {
    d.outcome = Done::kDisconnected;
  } else {
    d.detail = r.ok() ? absl::StrCat("stream ended before its first token (HTTP ", r->status,
                                     "): ", seen.substr(0, 300))
                      : std::string(r.status().message());
  }
  return d;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

// Waits until `address` holds nothing; returns its last /health.
json Drained(const std::string& address, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  json last;
  while (absl::Now() < deadline) {
    absl::StatusOr<json> h = GetJson(address, "/health");
    if (h.ok()) {
      last = *h;
      if (last.value("used_blocks", 1) == 0 && last.value("held_blocks", 1) == 0 &&
          last.value("live_connector_requests", 1) == 0 && last.value("active_requests", 1) == 0 &&
          last["admission"].value("queue_length", 1) == 0) {
        return last;
      }
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return last;
}

class SoakTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SoakTest, EveryRequestCompletesExactlyOrFailsForAnInjectedReason) {
  const std::string transport = GetParam();
  // Sanitizer builds run a smaller short form (their model is several times slower on the
  // same two cores); `make soak` and the gcc build run the full one.
  const bool slow = test_support::kServerDeadlineScale > 1;
  const size_t requests = static_cast<size_t>(EnvInt("KVWIRE_SOAK_REQUESTS", slow ? 16 : 40));
  const int concurrency = static_cast<int>(EnvInt("KVWIRE_SOAK_CONCURRENCY", slow ? 8 : 32));
  const absl::Duration budget = absl::Seconds(EnvInt("KVWIRE_SOAK_SECONDS", 300));
  std::mt19937 rng(static_cast<uint32_t>(EnvInt("KVWIRE_SOAK_SEED", 18)));

  // Default capacity flags (--num-blocks, --max-requests, --max-queue, --max-queue-wait-s):
  // the soak checks that they carry this load without refusing a request.
  test_support::ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  const std::vector<std::string> flags = {"--request-timeout-s", absl::StrCat(kRequestTimeoutS)};
  absl::StatusOr<std::string> both = c.Serve("both", "both", transport, flags);
  ASSERT_TRUE(both.ok()) << both.status();
  absl::StatusOr<std::string> p = c.Serve("prefill", "prefill", transport, flags);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> d1 = c.Serve("decode1", "decode", transport, flags);
  ASSERT_TRUE(d1.ok()) << d1.status();
  absl::StatusOr<std::string> d2 = c.Serve("decode2", "decode", transport, flags);
  ASSERT_TRUE(d2.ok()) << d2.status();
  const std::string decodes = absl::StrCat(*d1, ",", *d2);
  absl::StatusOr<std::string> rr = c.Router("router-read", *p, decodes, "read");
  ASSERT_TRUE(rr.ok()) << rr.status();
  absl::StatusOr<std::string> rw = c.Router("router-write", *p, decodes, "write");
  ASSERT_TRUE(rw.ok()) << rw.status();

  // The reference: the aggregated server's tokens for every distinct prompt (greedy), asked
  // all at once (its own admission queue holds what does not fit).
  const absl::Time setup = absl::Now();
  const std::vector<std::string> prompts = Prompts(rng, std::clamp<size_t>(requests / 3, 1, 48));
  std::vector<std::vector<int32_t>> want(prompts.size());
  {
    std::vector<std::thread> ts;
    std::vector<std::string> errors(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      ts.emplace_back([&, i] {
        absl::StatusOr<CompletionResult> r = Complete(
            *both, {{"prompt", prompts[i]}, {"max_tokens", kMaxTokens}, {"temperature", 0}},
            absl::Seconds(120 * test_support::kServerDeadlineScale));
        if (!r.ok() || r->status != 200 || r->tokens.size() != kMaxTokens) {
          errors[i] = r.ok() ? absl::StrCat(r->status, " ", r->error) : r.status().ToString();
        } else {
          want[i] = r->tokens;
        }
      });
    }
    for (std::thread& t : ts) t.join();
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_TRUE(errors[i].empty()) << "reference " << i << ": " << errors[i] << c.Logs();
    }
  }

  std::vector<Planned> plan(requests);
  for (Planned& r : plan) {
    r.prompt = rng() % prompts.size();
    r.write = rng() % 2 == 1;
    r.stream = rng() % 2 == 1;
    const int f = static_cast<int>(rng() % 100);
    if (f < 10) {
      r.fault = Fault::kDisconnect;
      r.stream = true;
    } else if (f < 20) {
      r.fault = Fault::kAbort;
      r.abort_ms = 5 + static_cast<int>(rng() % 200);
    }
  }

  std::vector<Done> done(requests);
  std::vector<absl::Time> started(requests), ended(requests);
  std::atomic<size_t> next{0}, finished{0};
  const absl::Time t0 = absl::Now();
  const absl::Time stop_at = t0 + budget;
  auto client = [&] {
    while (absl::Now() < stop_at) {
      const size_t i = next.fetch_add(1);
      if (i >= requests) return;
      const Planned& r = plan[i];
      const std::string& router = r.write ? *rw : *rr;
      const json body = {{"prompt", prompts[r.prompt]},
                         {"max_tokens", kMaxTokens},
                         {"stream", r.stream},
                         {"temperature", 0}};
      started[i] = absl::Now();
      Done& d = done[i];
      if (r.fault == Fault::kDisconnect) {
        d = Disconnect(router, body);
      } else {
        const absl::Duration limit = r.fault == Fault::kAbort
                                         ? absl::Milliseconds(r.abort_ms)
                                         : absl::Seconds(120 * test_support::kServerDeadlineScale);
        absl::StatusOr<CompletionResult> res = Complete(router, body, limit);
        if (!res.ok()) {
          d.detail = std::string(res.status().message());
          if (r.fault == Fault::kAbort && absl::IsDeadlineExceeded(res.status())) {
            d.outcome = Done::kAborted;
          }
        } else if (res->status != 200 || !res->error.empty() || (r.stream && !res->done)) {
          d.detail = absl::StrCat("HTTP ", res->status, ": ", res->error);
        } else if (res->tokens != want[r.prompt]) {
          d.detail =
              absl::StrCat("tokens differ from the aggregated server's (", json(res->tokens).dump(),
                           " vs ", json(want[r.prompt]).dump(), ")");
        } else {
          d.outcome = Done::kOk;
          d.ms = res->total_ms;
        }
      }
      ended[i] = absl::Now();
      ++finished;
    }
  };
  std::vector<std::thread> clients;
  for (int k = 0; k < concurrency; ++k) clients.emplace_back(client);
  // One decode dies a third of the way in, and comes back on its port. From this thread:
  // children die with the thread that started them (PR_SET_PDEATHSIG).
  while (finished.load() < requests / 3 && absl::Now() < stop_at) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  // What names the decode about to die in an error: its HTTP address, and the connector's
  // engine id and kv address (a prefill whose transfer to it broke names its peer by those).
  std::vector<std::string> killed_names = {*d1};
  if (absl::StatusOr<json> h = GetJson(*d1, "/health"); h.ok()) {
    for (const char* key : {"engine_id", "kv_address"}) {
      if (h->contains(key) && (*h)[key].is_string() && !(*h)[key].get<std::string>().empty()) {
        killed_names.push_back((*h)[key].get<std::string>());
      }
    }
  }
  const absl::Time killed_at = absl::Now();
  const absl::Status restart = c.KillAndRestart("decode1");
  for (std::thread& t : clients) t.join();
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - t0);
  const double reference_s = absl::ToDoubleSeconds(t0 - setup);
  ASSERT_TRUE(restart.ok()) << restart << c.Logs();
  ASSERT_GE(next.load(), requests)
      << "the load did not finish within " << absl::FormatDuration(budget) << " ("
      << finished.load() << " of " << requests << " requests done)";

  // Failures are the kill's only if the request was in flight when it happened and the error
  // names the killed decode itself (every router error names some upstream: one naming the
  // surviving decode or only the prefill is not the kill's).
  // A name matches whole: "127.0.0.1:4000" does not match inside "127.0.0.1:40001".
  auto names_killed = [&](const std::string& detail) {
    for (const std::string& n : killed_names) {
      for (size_t at = detail.find(n); at != std::string::npos; at = detail.find(n, at + 1)) {
        const size_t end = at + n.size();
        if (end == detail.size() || !absl::ascii_isalnum(static_cast<unsigned char>(detail[end])))
          return true;
      }
    }
    return false;
  };
  std::map<std::string, int> unexpected, by_kill;
  int count[5] = {};
  std::vector<double> ok_ms;
  size_t reads = 0;
  for (size_t i = 0; i < requests; ++i) {
    Done& d = done[i];
    reads += plan[i].write ? 0 : 1;
    if (d.outcome == Done::kUnexpected && started[i] <= killed_at && ended[i] >= killed_at &&
        names_killed(d.detail)) {
      d.outcome = Done::kKilled;
      ++by_kill[absl::StrCat(plan[i].write ? "write" : "read", plan[i].stream ? " stream" : "",
                             ": ", d.detail.substr(0, 160))];
    }
    ++count[d.outcome];
    if (d.outcome == Done::kOk) ok_ms.push_back(d.ms);
    if (d.outcome == Done::kUnexpected) {
      ++unexpected[absl::StrCat(plan[i].write ? "write" : "read", plan[i].stream ? " stream" : "",
                                ": ", d.detail)];
    }
  }

  // Every instance gives back every block; counters balance.
  const std::vector<std::pair<std::string, std::string>> instances = {
      {"both", *both}, {"prefill", *p}, {"decode1 (restarted)", *d1}, {"decode2", *d2}};
  uint64_t leaked = 0, expired = 0, waited = 0, rejected = 0;
  double max_wait_ms = 0;
  std::string balances;
  for (const auto& [name, address] : instances) {
    const json h = Drained(address, absl::Seconds(kRequestTimeoutS + 15));
    SCOPED_TRACE(absl::StrCat(name, " /health: ", h.dump()));
    ASSERT_TRUE(h.is_object());
    const uint64_t used = h.value("used_blocks", uint64_t{1}),
                   held = h.value("held_blocks", uint64_t{1});
    leaked += used + held;
    EXPECT_EQ(used, 0u);
    EXPECT_EQ(held, 0u);
    EXPECT_EQ(h.value("live_connector_requests", 1), 0);
    EXPECT_EQ(h.value("active_requests", 1), 0);
    const json& e = h["engine_transfers"];
    const uint64_t es = e.value("started", uint64_t{0});
    const uint64_t ee = e.value("succeeded", uint64_t{0}) + e.value("failed", uint64_t{0});
    EXPECT_EQ(es, ee) << "engine transfers started != ended";
    const json& cn = h["connector"];
    const uint64_t cs = cn.value("started", uint64_t{0});
    const uint64_t ce = cn.value("completed", uint64_t{0}) + cn.value("failed", uint64_t{0}) +
                        cn.value("withdrawn", uint64_t{0}) + cn.value("released", uint64_t{0});
    EXPECT_EQ(cs, ce) << "connector requests started != ended";
    EXPECT_EQ(cn.value("live_requests", 1), 0);
    const json& a = h["admission"];
    const uint64_t overload = a["rejected"].value("queue_full", uint64_t{0}) +
                              a["rejected"].value("wait_deadline", uint64_t{0}) +
                              a["rejected"].value("too_large", uint64_t{0});
    EXPECT_EQ(overload, 0u) << "the default capacity refused requests at concurrency "
                            << concurrency;
    rejected += overload;
    waited += a.value("waited", uint64_t{0});
    max_wait_ms = std::max(max_wait_ms, a.value("wait_ms_max", 0.0));
    expired += cn.value("lease_expired", uint64_t{0});
    absl::StrAppend(&balances, "\n  ", name, ": used ", used, " held ", held,
                    "; engine transfers started ", es, " ended ", ee,
                    "; connector requests started ", cs, " ended ", ce, "; admission waited ",
                    a.value("waited", 0), " (max ", a.value("wait_ms_max", 0.0), " ms)");
  }

  const double drain_s = absl::ToDoubleSeconds(absl::Now() - t0) - wall_s;
  std::string unexpected_text, kill_text;
  for (const auto& [why, n] : unexpected) absl::StrAppend(&unexpected_text, "\n  ", n, "x ", why);
  for (const auto& [why, n] : by_kill) absl::StrAppend(&kill_text, "\n    ", n, "x ", why);
  std::printf(
      "soak %s: %zu requests (%zu read, %zu write) at concurrency %d in %.1f s (reference %.1f "
      "s, drain %.1f s)\n"
      "  completed with the aggregated server's tokens: %d\n"
      "  injected: disconnected mid-stream %d, aborted by the client %d, failed by the decode "
      "kill %d%s\n"
      "  unexpected errors: %d%s\n"
      "  latency of completed requests: p50 %.0f ms, p99 %.0f ms\n"
      "  leaked blocks: %llu; read-mode leases expired: %llu; admission: %llu waited (max "
      "%.0f ms), %llu refused%s\n",
      transport.c_str(), requests, reads, requests - reads, concurrency, wall_s, reference_s,
      drain_s, count[Done::kOk], count[Done::kDisconnected], count[Done::kAborted],
      count[Done::kKilled], kill_text.c_str(), count[Done::kUnexpected], unexpected_text.c_str(),
      Percentile(ok_ms, 0.5), Percentile(ok_ms, 0.99), static_cast<unsigned long long>(leaked),
      static_cast<unsigned long long>(expired), static_cast<unsigned long long>(waited),
      max_wait_ms, static_cast<unsigned long long>(rejected), balances.c_str());
  std::fflush(stdout);
  EXPECT_EQ(count[Done::kUnexpected], 0) << unexpected_text << c.Logs();
  // Most requests complete; in the sanitizers' 16-request form the injected faults and the
  // kill take a larger share, so a third must.
  EXPECT_GT(count[Done::kOk], static_cast<int>(slow ? requests / 3 : requests / 2));
  EXPECT_EQ(leaked, 0u);
}

INSTANTIATE_TEST_SUITE_P(Transports, SoakTest, ::testing::Values("tcp", "shm"));

}  // namespace
}  // namespace dsv4::serve
