// Admission control without a model: block counting per cache group, the waiting queue
// (arrival order, bound, deadline, clients that leave), its metrics, and the 503 with
// Retry-After that an overloaded server sends and the router passes on, over real sockets.
#include "examples/dsv4/serve/admission.h"

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/http_server.h"
#include "examples/dsv4/serve/router.h"
#include "kvwire/layout.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;

// Two paged groups of different block sizes and one state group.
kvwire::Layout TestLayout(uint64_t blocks, uint64_t slots) {
  kvwire::Layout l;
  kvwire::CacheGroup swa;
  swa.name = "swa";
  swa.layers = {0, 1};
  swa.tokens_per_block = 64;
  swa.page_bytes = 1000;
  swa.num_blocks = blocks;
  kvwire::CacheGroup c4;
  c4.name = "c4";
  c4.layers = {1};
  c4.tokens_per_block = 256;
  c4.tokens_per_entry = 4;
  c4.page_bytes = 100;
  c4.num_blocks = blocks;
  kvwire::CacheGroup state;
  state.name = "state";
  state.layers = {1};
  state.tokens_per_block = 8;
  state.page_bytes = 10;
  state.per_request_state = true;
  state.num_blocks = slots;
  l.groups = {swa, c4, state};
  return l;
}

TEST(BlockCounting, NeedsCapacityGrowthAndShortfall) {
  const kvwire::Layout l = TestLayout(10, 2);
  EXPECT_EQ(BlocksNeeded(l, 1), (BlockCounts{{"swa", 1}, {"c4", 1}, {"state", 1}}));
  EXPECT_EQ(BlocksNeeded(l, 64), (BlockCounts{{"swa", 1}, {"c4", 1}, {"state", 1}}));
  EXPECT_EQ(BlocksNeeded(l, 65), (BlockCounts{{"swa", 2}, {"c4", 1}, {"state", 1}}));
  EXPECT_EQ(BlocksNeeded(l, 257), (BlockCounts{{"swa", 5}, {"c4", 2}, {"state", 1}}));
  EXPECT_EQ(Capacity(l), (BlockCounts{{"swa", 10}, {"c4", 10}, {"state", 2}}));

  // A request that holds 2 swa blocks (one of them -1: none) and may grow to 4.
  BlockCounts avail = {{"swa", 5}, {"c4", 3}, {"state", 1}};
  SubtractGrowth({{"swa", 4}, {"c4", 1}, {"state", 1}},
                 {{"swa", {7, -1, 3}}, {"c4", {2}}, {"state", {0}}}, &avail);
  EXPECT_EQ(avail, (BlockCounts{{"swa", 3}, {"c4", 3}, {"state", 1}}));
  // Growth past what is free takes it to zero, never below.
  SubtractGrowth({{"swa", 40}}, {}, &avail);
  EXPECT_EQ(avail["swa"], 0u);

  EXPECT_EQ(Shortfall({{"swa", 2}, {"state", 1}}, {{"swa", 2}, {"state", 1}}), "");
  EXPECT_EQ(Shortfall({{"swa", 2}, {"state", 1}}, {{"swa", 2}, {"state", 0}}),
            "group 'state': 1 needed, 0 available");
  EXPECT_EQ(Shortfall({{"other", 1}}, {}), "group 'other': 1 needed, 0 available");

  const CacheFootprint f = Footprint(l);
  EXPECT_EQ(f.block_bytes, 2 * 1000u + 100u);
  EXPECT_EQ(f.slot_bytes, 10u);
  EXPECT_EQ(f.blocks, 10u);
  EXPECT_EQ(f.slots, 2u);
  EXPECT_EQ(f.total_bytes, 10 * 2100u + 2 * 10u);
}

struct TestJob {
  int id = 0;
  bool gone = false;
};

struct Outcome {
  std::vector<int> admitted;
  std::vector<std::pair<int, std::string>> refused;  // id, reason name + message
};

// Pumps with `avail` free blocks; each admission takes its need from them.
void Pump(AdmissionQueue<TestJob>& q, BlockCounts& avail, const std::map<int, BlockCounts>& needs,
          Outcome* out, absl::Time now = absl::Now()) {
  q.Pump(
      now, [&] { return avail; }, [](const TestJob& j) { return j.gone; },
      [&](TestJob& j) {
        for (const auto& [g, n] : needs.at(j.id)) avail[g] -= n;
        out->admitted.push_back(j.id);
      },
      [&](TestJob& j, Rejection why, const std::string& message) {
        out->refused.push_back({j.id, absl::StrCat(RejectionName(why), ": ", message)});
      });
}

TEST(AdmissionQueue, WaitsInArrivalOrderUntilBlocksFree) {
  const kvwire::Layout l = TestLayout(10, 3);
  AdmissionOptions o;
  o.max_queue = 8;
  o.max_wait = absl::Hours(1);
  AdmissionQueue<TestJob> q(o, Capacity(l));
  std::map<int, BlockCounts> needs = {{1, BlocksNeeded(l, 300)},  // 5 swa
                                      {2, BlocksNeeded(l, 400)},  // 7 swa: waits for 1
                                      {3, BlocksNeeded(l, 10)}};  // 1 swa: waits behind 2
  for (int id : {1, 2, 3}) {
    TestJob j{id};
    ASSERT_TRUE(q.Offer(j, needs[id], absl::Now()).ok());
  }
  EXPECT_EQ(q.stats().queue_length(), 3u);
  BlockCounts avail = Capacity(l);
  Outcome out;
  Pump(q, avail, needs, &out);
  // 3 would fit now, but 2 came first: strict arrival order.
  EXPECT_EQ(out.admitted, std::vector<int>({1}));
  EXPECT_EQ(q.size(), 2u);
  Pump(q, avail, needs, &out);
  EXPECT_EQ(out.admitted, std::vector<int>({1}));
  // 1 finishes: its blocks come back, 2 and 3 go in.
  for (const auto& [g, n] : needs[1]) avail[g] += n;
  Pump(q, avail, needs, &out);
  EXPECT_EQ(out.admitted, std::vector<int>({1, 2, 3}));
  EXPECT_TRUE(out.refused.empty());
  EXPECT_EQ(q.size(), 0u);
  const json s = q.stats().Json(o.max_queue);
  EXPECT_EQ(s["admitted"], 3);
  EXPECT_EQ(s["waited"], 2);  // 1 went in at once
  EXPECT_EQ(s["queue_length"], 0);
  EXPECT_GT(s["wait_ms_max"].get<double>(), 0.0);
}

TEST(AdmissionQueue, StateSlotsAreWaitedForLikeBlocks) {
  const kvwire::Layout l = TestLayout(100, 1);  // one slot: the failure of issue 18
  AdmissionQueue<TestJob> q({}, Capacity(l));
  std::map<int, BlockCounts> needs = {{1, BlocksNeeded(l, 5)}, {2, BlocksNeeded(l, 5)}};
  for (int id : {1, 2}) {
    TestJob j{id};
    ASSERT_TRUE(q.Offer(j, needs[id], absl::Now()).ok());
  }
  BlockCounts avail = Capacity(l);
  Outcome out;
  Pump(q, avail, needs, &out);
  EXPECT_EQ(out.admitted, std::vector<int>({1}));
  avail["state"] = 1;
  Pump(q, avail, needs, &out);
  EXPECT_EQ(out.admitted, std::vector<int>({1, 2}));
}

TEST(AdmissionQueue, FullQueueAndTooLargeAreRefusedAtOnceWithTheReason) {
  const kvwire::Layout l = TestLayout(4, 2);
  AdmissionOptions o;
  o.max_queue = 2;
  AdmissionQueue<TestJob> q(o, Capacity(l));
  const BlockCounts small = BlocksNeeded(l, 10);
  for (int id : {1, 2}) {
    TestJob j{id};
    ASSERT_TRUE(q.Offer(j, small, absl::Now()).ok());
  }
  TestJob third{3};
  absl::Status s = q.Offer(third, small, absl::Now());
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("admission queue is full"), std::string::npos) << s;
  EXPECT_NE(s.message().find("--max-queue"), std::string::npos) << s;
  EXPECT_EQ(third.id, 3);  // left with the caller, who answers it

  TestJob huge{4};
  s = q.Offer(huge, BlocksNeeded(l, 64 * 5), absl::Now());
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("group 'swa': 5 needed, 4 available"), std::string::npos) << s;
  EXPECT_NE(s.message().find("--num-blocks"), std::string::npos) << s;
  EXPECT_EQ(q.size(), 2u);

  const std::string m = q.stats().Prometheus("e1");
  EXPECT_NE(m.find("kvwire_dsv4_admission_rejected_total{engine=\"e1\",reason=\"queue_full\"} 1"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("kvwire_dsv4_admission_rejected_total{engine=\"e1\",reason=\"too_large\"} 1"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("kvwire_dsv4_admission_queue_length{engine=\"e1\"} 2"), std::string::npos) << m;
}

TEST(AdmissionQueue, DeadlineAndDepartedClientsAreRefusedNamingWhatWasMissing) {
  const kvwire::Layout l = TestLayout(4, 2);
  AdmissionOptions o;
  o.max_wait = absl::Seconds(5);
  AdmissionQueue<TestJob> q(o, Capacity(l));
  const absl::Time t0 = absl::Now();
  std::map<int, BlockCounts> needs = {
      {1, BlocksNeeded(l, 200)}, {2, BlocksNeeded(l, 10)}, {3, BlocksNeeded(l, 10)}};
  TestJob a{1}, b{2, /*gone=*/true}, c{3};
  ASSERT_TRUE(q.Offer(a, needs[1], t0).ok());
  ASSERT_TRUE(q.Offer(b, needs[2], t0).ok());
  ASSERT_TRUE(q.Offer(c, needs[3], t0 + absl::Seconds(4)).ok());
  BlockCounts avail = {{"swa", 1}, {"c4", 4}, {"state", 2}};
  Outcome out;
  Pump(q, avail, needs, &out, t0 + absl::Seconds(1));
  // The departed client is dropped at once; 1 still waits for its 4 swa blocks.
  ASSERT_EQ(out.refused.size(), 1u);
  EXPECT_EQ(out.refused[0].first, 2);
  EXPECT_EQ(out.refused[0].second.rfind("client_gone", 0), 0u) << out.refused[0].second;
  Pump(q, avail, needs, &out, t0 + absl::Seconds(6));
  // 1 waited past its 5 s and is refused with the group it lacked; 3 is admitted behind it.
  ASSERT_EQ(out.refused.size(), 2u);
  EXPECT_EQ(out.refused[1].first, 1);
  EXPECT_NE(out.refused[1].second.find("wait_deadline: server overloaded: waited 6s"),
            std::string::npos)
      << out.refused[1].second;
  EXPECT_NE(out.refused[1].second.find("group 'swa': 4 needed, 1 available"), std::string::npos)
      << out.refused[1].second;
  EXPECT_EQ(out.admitted, std::vector<int>({3}));

  TestJob d{5};
  ASSERT_TRUE(q.Offer(d, needs[1], t0).ok());
  q.Drain([&](TestJob& j, Rejection why, const std::string& message) {
    out.refused.push_back({j.id, absl::StrCat(RejectionName(why), ": ", message)});
  });
  ASSERT_EQ(out.refused.size(), 3u);
  EXPECT_EQ(out.refused[2].second, "shutdown: server is shutting down");
  const json s = q.stats().Json(o.max_queue);
  EXPECT_EQ(s["rejected"]["wait_deadline"], 1);
  EXPECT_EQ(s["rejected"]["client_gone"], 1);
  EXPECT_EQ(s["rejected"]["shutdown"], 1);
  EXPECT_EQ(s["queue_length"], 0);
}

// Time spent waiting for its turn (the worker busy with earlier requests) is no reason to
// refuse a request that fits: only one that waited for blocks past its deadline is refused.
TEST(AdmissionQueue, ARequestThatFitsIsAdmittedHoweverLongItWaitedForItsTurn) {
  const kvwire::Layout l = TestLayout(10, 2);
  AdmissionOptions o;
  o.max_wait = absl::Seconds(1);
  AdmissionQueue<TestJob> q(o, Capacity(l));
  const absl::Time t0 = absl::Now();
  std::map<int, BlockCounts> needs = {{1, BlocksNeeded(l, 10)}};
  TestJob j{1};
  ASSERT_TRUE(q.Offer(j, needs[1], t0).ok());
  BlockCounts avail = Capacity(l);
  Outcome out;
  Pump(q, avail, needs, &out, t0 + absl::Seconds(40));
  EXPECT_EQ(out.admitted, std::vector<int>({1}));
  EXPECT_TRUE(out.refused.empty());
  EXPECT_EQ(q.stats().Json(o.max_queue)["waited"], 0);  // it never waited for blocks
}

// An overloaded upstream's 503 and Retry-After reach the client through the router (any
// other server error is a 502). The router's own limit: TheRoutersInflightLimitIsA503...
TEST(RetryAfter, OverloadedUpstreamIsA503WithRetryAfterThroughTheRouter) {
  auto serve = [](bool retry_after) {
    HttpServerOptions o;
    return HttpServer::Start(o, [retry_after](const HttpRequest&, std::shared_ptr<Responder> r) {
      if (retry_after) {
        r->ErrorRetryAfter(503, "server overloaded: the admission queue is full", absl::Seconds(3));
      } else {
        r->Error(503, "something else broke");
      }
    });
  };
  for (bool retry_after : {true, false}) {
    SCOPED_TRACE(retry_after ? "overloaded" : "plain 503");
    absl::StatusOr<std::unique_ptr<HttpServer>> prefill = serve(retry_after);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    const std::string addr = absl::StrCat("127.0.0.1:", (*prefill)->port());
    // The upstream itself.
    absl::StatusOr<HttpResponse> direct = HttpCall(addr, "POST", "/v1/completions", "{}");
    ASSERT_TRUE(direct.ok()) << direct.status();
    EXPECT_EQ(direct->status, 503);
    EXPECT_EQ(direct->retry_after, retry_after ? "3" : "");
    // Decode is a second server of the same kind: the router's instance set keeps one role
    // per address, and the prefill's answer is the one under test.
    absl::StatusOr<std::unique_ptr<HttpServer>> decode = serve(retry_after);
    ASSERT_TRUE(decode.ok()) << decode.status();
    RouterOptions ro;
    ro.prefill = {addr};
    ro.decode = {absl::StrCat("127.0.0.1:", (*decode)->port())};
    absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(ro);
    ASSERT_TRUE(router.ok()) << router.status();
    absl::StatusOr<HttpResponse> r =
        HttpCall(absl::StrCat("127.0.0.1:", (*router)->port()), "POST", "/v1/completions",
                 json{{"prompt", "hello"}, {"max_tokens", 2}}.dump());
    ASSERT_TRUE(r.ok()) << r.status();
    if (retry_after) {
      EXPECT_EQ(r->status, 503) << r->body;
      EXPECT_EQ(r->retry_after, "3");
      EXPECT_NE(r->body.find("admission queue is full"), std::string::npos) << r->body;
    } else {
      EXPECT_EQ(r->status, 502) << r->body;
      EXPECT_EQ(r->retry_after, "");
    }
  }
}

// The router's own limit: with max_inflight requests in flight, the next one is refused at
// once with 503 and Retry-After (the client backs off), not queued and not a 502.
TEST(RetryAfter, TheRoutersInflightLimitIsA503WithRetryAfter) {
  // An upstream that holds every request until the test lets it answer.
  std::mutex mu;
  std::vector<std::shared_ptr<Responder>> held;
  std::atomic<int> arrived{0};
  HttpServerOptions o;
  absl::StatusOr<std::unique_ptr<HttpServer>> upstream =
      HttpServer::Start(o, [&](const HttpRequest&, std::shared_ptr<Responder> r) {
        std::lock_guard<std::mutex> lock(mu);
        held.push_back(std::move(r));
        ++arrived;
      });
  ASSERT_TRUE(upstream.ok()) << upstream.status();
  absl::StatusOr<std::unique_ptr<HttpServer>> decode =
      HttpServer::Start(o, [](const HttpRequest&, std::shared_ptr<Responder> r) {
        r->Error(500, "decode is not reached in this test");
      });
  ASSERT_TRUE(decode.ok()) << decode.status();
  RouterOptions ro;
  ro.prefill = {absl::StrCat("127.0.0.1:", (*upstream)->port())};
  ro.decode = {absl::StrCat("127.0.0.1:", (*decode)->port())};
  ro.max_inflight = 1;
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(ro);
  ASSERT_TRUE(router.ok()) << router.status();
  const std::string addr = absl::StrCat("127.0.0.1:", (*router)->port());
  const std::string body = json{{"prompt", "hello"}, {"max_tokens", 2}}.dump();

  absl::StatusOr<HttpResponse> first = absl::UnknownError("not run");
  std::thread t([&] { first = HttpCall(addr, "POST", "/v1/completions", body); });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (arrived.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(arrived.load(), 1) << "the first request never reached the upstream";

  absl::StatusOr<HttpResponse> second = HttpCall(addr, "POST", "/v1/completions", body);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const std::shared_ptr<Responder>& r : held) r->Error(503, "released by the test");
    held.clear();
  }
  t.join();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->status, 503) << second->body;
  EXPECT_EQ(second->retry_after, "1");
  EXPECT_NE(second->body.find("too many requests in flight (1)"), std::string::npos)
      << second->body;
  EXPECT_EQ(arrived.load(), 1) << "the refused request still reached the upstream";
  // The first one was in flight, not refused: it ends with the upstream's answer.
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->status, 502) << first->body;
}

// A request with n choices counts as n requests in flight against the router's limit (its
// choices, sent to the router itself, count no more): with a limit of 2, n = 2 runs both
// choices; n = 2 beside one request in flight is refused at once; n above the limit is a
// 400; and a client cannot pass for a choice to slip past the limit.
TEST(RetryAfter, RequestsWithNChoicesCountNAgainstTheRoutersLimit) {
  std::mutex mu;
  std::vector<std::shared_ptr<Responder>> held;
  std::atomic<int> arrived{0};
  HttpServerOptions o;
  absl::StatusOr<std::unique_ptr<HttpServer>> upstream =
      HttpServer::Start(o, [&](const HttpRequest& req, std::shared_ptr<Responder> r) {
        if (req.method != "POST") {  // the router's instance polls are not requests
          r->Error(404, "not a completion");
          return;
        }
        std::lock_guard<std::mutex> lock(mu);
        held.push_back(std::move(r));
        ++arrived;
      });
  ASSERT_TRUE(upstream.ok()) << upstream.status();
  absl::StatusOr<std::unique_ptr<HttpServer>> decode =
      HttpServer::Start(o, [](const HttpRequest&, std::shared_ptr<Responder> r) {
        r->Error(500, "decode is not reached in this test");
      });
  ASSERT_TRUE(decode.ok()) << decode.status();
  RouterOptions ro;
  ro.prefill = {absl::StrCat("127.0.0.1:", (*upstream)->port())};
  ro.decode = {absl::StrCat("127.0.0.1:", (*decode)->port())};
  ro.max_inflight = 2;
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(ro);
  ASSERT_TRUE(router.ok()) << router.status();
  const std::string addr = absl::StrCat("127.0.0.1:", (*router)->port());
  // No temperature: vLLM's default (1) samples, so n > 1 is allowed.
  const std::string one = json{{"prompt", "hello"}, {"max_tokens", 2}}.dump();
  const std::string two = json{{"prompt", "hello"}, {"max_tokens", 2}, {"n", 2}}.dump();
  const std::string three = json{{"prompt", "hello"}, {"max_tokens", 2}, {"n", 3}}.dump();
  auto wait_arrived = [&](int n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (arrived.load() < n && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    return arrived.load();
  };
  auto release = [&] {
    std::lock_guard<std::mutex> lock(mu);
    for (const std::shared_ptr<Responder>& r : held) r->Error(500, "released by the test");
    held.clear();
  };
  auto inflight = [&] {
    absl::StatusOr<HttpResponse> h = HttpCall(addr, "GET", "/health", "");
    if (!h.ok()) return -1;
    const json j = json::parse(h->body, nullptr, false);
    return j.is_object() ? j.value("inflight", -1) : -1;
  };
  auto wait_idle = [&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (inflight() != 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    return inflight();
  };

  // One request in flight: n = 2 does not fit beside it.
  absl::StatusOr<HttpResponse> first = absl::UnknownError("not run");
  std::thread t1([&] { first = HttpCall(addr, "POST", "/v1/completions", one); });
  ASSERT_EQ(wait_arrived(1), 1) << "the first request never reached the upstream";
  absl::StatusOr<HttpResponse> refused = HttpCall(addr, "POST", "/v1/completions", two);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->status, 503) << refused->body;
  EXPECT_EQ(refused->retry_after, "1");
  EXPECT_NE(refused->body.find("too many requests in flight (2)"), std::string::npos)
      << refused->body;
  EXPECT_EQ(arrived.load(), 1) << "a choice of the refused request reached the upstream";
  release();
  t1.join();
  ASSERT_EQ(wait_idle(), 0);

  // Alone, n = 2 fills the limit exactly: both choices reach the upstream.
  absl::StatusOr<HttpResponse> pair = absl::UnknownError("not run");
  std::thread t2([&] { pair = HttpCall(addr, "POST", "/v1/completions", two); });
  EXPECT_EQ(wait_arrived(3), 3) << "a choice was refused by the router's own limit";
  EXPECT_EQ(inflight(), 2);
  // The choices' marker, forged by a client, counts like any request: refused while full.
  for (const char* target :
       {"/v1/completions?kvwire_choice=", "/v1/completions?kvwire_choice=0123456789abcdef"}) {
    absl::StatusOr<HttpResponse> forged = HttpCall(addr, "POST", target, one);
    ASSERT_TRUE(forged.ok()) << forged.status();
    EXPECT_EQ(forged->status, 503) << target << ": " << forged->body;
  }
  EXPECT_EQ(arrived.load(), 3);
  release();
  t2.join();
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_EQ(pair->status, 502) << pair->body;  // the upstream's error, not the router's limit
  EXPECT_EQ(pair->body.find("too many requests in flight"), std::string::npos) << pair->body;
  EXPECT_EQ(wait_idle(), 0);

  // More choices than the limit can ever hold: a 400 that names both.
  absl::StatusOr<HttpResponse> big = HttpCall(addr, "POST", "/v1/completions", three);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->status, 400) << big->body;
  EXPECT_NE(big->body.find("'n' (3)"), std::string::npos) << big->body;
  EXPECT_NE(big->body.find("--max-inflight 2"), std::string::npos) << big->body;
  EXPECT_EQ(arrived.load(), 3);
  ASSERT_TRUE(first.ok()) << first.status();
}

}  // namespace
}  // namespace dsv4::serve
