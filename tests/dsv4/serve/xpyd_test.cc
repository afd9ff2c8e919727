// xPyD through etcd: a real etcd member (started here), a router that discovers its instances
// (--etcd --cluster), two prefill and two decode kvwire-dsv4 servers that register themselves,
// and an aggregated server (role both) as the reference. Every token must equal the
// aggregated server's; a decode SIGKILLed mid-stream gives its clients a clean error while the
// others finish; its key goes with its lease and the router drops it; a replacement decode
// that registers gets the next requests; with etcd itself gone, known instances keep serving;
// every survivor ends with no block in use. Routing is by load (least_loaded), visible in the
// router's metrics.
#include <functional>
#include <map>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/client.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/process.h"
#include "tests/dsv4/serve/serve_cluster.h"
#include "tests/support/etcd_cluster.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;
using test_support::PromptOfTokens;
using test_support::WaitFor;

constexpr int kMaxTokens = 8;

// The deployment on the serving tests' ServeCluster: one thread a server, a 20 s request
// deadline, a 2 s peer lease; only a process the test killed (Kill) may be gone before
// teardown, any other that ended by itself (a crash, a sanitizer report, an early exit 0)
// fails the test.
class Deployment {
 public:
  explicit Deployment(std::string etcd)
      : etcd_(std::move(etcd)),
        cluster_(
            {.dir_tag = "xpyd", .threads = 1, .peer_lease_ms = 2000, .request_timeout_s = 20}) {}

  absl::Status MakeWeights() { return cluster_.MakeWeights(); }

  // A model server; registered in etcd unless `role` is both (the reference).
  absl::StatusOr<std::string> Serve(const std::string& name, const std::string& role,
                                    const std::string& transport, int delay_ms = 0) {
    std::vector<std::string> extra = {"--name", name, "--inject-delay-ms", absl::StrCat(delay_ms)};
    if (role != "both") {
      extra.insert(extra.end(), {"--etcd", etcd_, "--cluster", "xpyd", "--etcd-lease-s", "2"});
    }
    return cluster_.Serve(name, role, transport, extra);
  }

  absl::StatusOr<std::string> Router(const std::string& mode) {
    return cluster_.Start("router", {"router", "--etcd", etcd_, "--cluster", "xpyd", "--mode", mode,
                                     "--policy", "least_loaded", "--timeout-s", "60"});
  }

  // SIGKILL on purpose: the one way a process may end before teardown.
  void Kill(const std::string& name) { cluster_.Kill(name); }

  std::string Logs() const { return cluster_.Logs(); }

 private:
  const std::string etcd_;
  test_support::ServeCluster cluster_;
};

// Greedy (the servers default to vLLM's temperature 1): every configuration the same tokens.
json Request(const std::string& prompt, bool stream) {
  return {{"prompt", prompt}, {"max_tokens", kMaxTokens}, {"stream", stream}, {"temperature", 0}};
}

// The router's instances of `kind` (its /health).
size_t Instances(const std::string& router, const std::string& kind) {
  absl::StatusOr<json> h = GetJson(router, "/health");
  if (!h.ok() || !h->contains(kind) || !(*h)[kind].is_array()) return 0;
  return (*h)[kind].size();
}

// routed_total of one decode instance in the router's metrics.
int64_t Routed(const std::string& router, const std::string& kind, const std::string& name) {
  HttpCallOptions o;
  absl::StatusOr<HttpResponse> m = HttpCall(router, "GET", "/metrics", "", o);
  if (!m.ok()) return -1;
  const std::string needle = absl::StrCat("kvwire_dsv4_router_routed_total{kind=\"", kind,
                                          "\",instance=\"", name, "\",policy=\"least_loaded\"} ");
  const size_t at = m->body.find(needle);
  if (at == std::string::npos) return 0;
  return std::atoll(m->body.c_str() + at + needle.size());
}

void ExpectDrained(const std::string& address, const std::string& what) {
  json last;
  const bool drained = WaitFor(
      [&] {
        absl::StatusOr<json> h = GetJson(address, "/health");
        if (!h.ok()) return false;
        last = *h;
        return last["used_blocks"] == 0 && last["live_connector_requests"] == 0 &&
               last["active_requests"] == 0;
      },
      absl::Seconds(40));
  EXPECT_TRUE(drained) << what << " still holds blocks: " << last.dump();
}

// Sends every request at once; results in order.
std::vector<absl::StatusOr<CompletionResult>> SendAll(const std::string& router,
                                                      const std::vector<json>& requests) {
  std::vector<absl::StatusOr<CompletionResult>> out(requests.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] { out[i] = Complete(router, requests[i], absl::Seconds(120)); });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

struct Param {
  const char* transport;
  const char* mode;
};
void PrintTo(const Param& p, std::ostream* os) { *os << p.transport << "/" << p.mode; }

class XpydTest : public ::testing::TestWithParam<Param> {};

TEST_P(XpydTest, DiscoveredThroughEtcdSurvivesDecodeDeathAndRejoin) {
  const std::string transport = GetParam().transport, mode = GetParam().mode;
  absl::StatusOr<std::unique_ptr<kvwire::testing::EtcdCluster>> etcd =
      kvwire::testing::EtcdCluster::Start(1);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  Deployment d((*etcd)->endpoints());
  ASSERT_TRUE(d.MakeWeights().ok());

  // The router first: nothing registered yet is a clear 503, not a hang.
  absl::StatusOr<std::string> router = d.Router(mode);
  ASSERT_TRUE(router.ok()) << router.status();
  absl::StatusOr<CompletionResult> none = Complete(*router, Request("x", false), absl::Seconds(30));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->status, 503);
  EXPECT_NE(none->error.find("registered in etcd cluster 'xpyd'"), std::string::npos)
      << none->error;

  absl::StatusOr<std::string> agg = d.Serve("agg", "both", transport);
  ASSERT_TRUE(agg.ok()) << agg.status();
  std::map<std::string, std::string> servers;  // name -> HTTP address
  for (const auto& [name, role] : std::vector<std::pair<std::string, std::string>>{
           {"p1", "prefill"}, {"p2", "prefill"}, {"d1", "decode"}, {"d2", "decode"}}) {
    // Decodes step slowly enough that a kill lands mid-stream.
    absl::StatusOr<std::string> a = d.Serve(name, role, transport, role == "decode" ? 40 : 0);
    ASSERT_TRUE(a.ok()) << a.status();
    servers[name] = *a;
  }
  ASSERT_TRUE(WaitFor(
      [&] { return Instances(*router, "prefill") == 2 && Instances(*router, "decode") == 2; },
      absl::Seconds(10)))
      << d.Logs();

  // Reference tokens from the aggregated server.
  std::vector<std::string> prompts;
  std::vector<std::vector<int32_t>> want;
  for (int n : {5, 127, 129, 300}) {
    prompts.push_back(PromptOfTokens(n));
    absl::StatusOr<CompletionResult> r =
        Complete(*agg, Request(prompts.back(), false), absl::Seconds(60));
    ASSERT_TRUE(r.ok() && r->status == 200) << (r.ok() ? r->error : r.status().ToString());
    want.push_back(r->tokens);
  }
  // Write mode: the prefill that pushed, as decode's connector names it (by engine id while
  // the router can reach etcd; by kv address once it cannot, step 4).
  std::set<std::string> pushers = {"p1", "p2"};
  auto expect_match = [&](const absl::StatusOr<CompletionResult>& r, size_t i) {
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->status, 200) << r->error << d.Logs();
    EXPECT_EQ(r->tokens, want[i % want.size()]) << "prompt " << i;
    // The KV moved over the transport asked for; in write mode the router named the prefill
    // by engine id alone and decode's connector resolved it through etcd (until step 4).
    const json& t = r->kvwire["transfer"];
    EXPECT_EQ(t.value("mode", ""), mode) << t.dump();
    EXPECT_NE(t.value("transport", "").find(transport), std::string::npos) << t.dump();
    if (mode == "write") {
      const std::string peer = t.value("peer", "");
      EXPECT_TRUE(pushers.contains(peer)) << t.dump();
    }
  };

  // 1. All at once: every token equals the aggregated server's, and the load spreads over
  // both decodes (least_loaded counts requests in flight).
  {
    std::vector<json> reqs;
    // Six: within the two decodes' slots (4 each) even if the load is read a little late.
    for (size_t i = 0; i < 6; ++i) reqs.push_back(Request(prompts[i % 4], i % 2 == 0));
    std::vector<absl::StatusOr<CompletionResult>> res = SendAll(*router, reqs);
    for (size_t i = 0; i < res.size(); ++i) expect_match(res[i], i);
    EXPECT_GT(Routed(*router, "decode", "d1"), 0);
    EXPECT_GT(Routed(*router, "decode", "d2"), 0);
    EXPECT_GT(Routed(*router, "prefill", "p1") + Routed(*router, "prefill", "p2"), 0);
  }

  // 2. d1 dies (SIGKILL) while it streams: its clients get an error, the others finish.
  {
    std::vector<absl::StatusOr<CompletionResult>> res(4, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (size_t i = 0; i < 4; ++i) {
      threads.emplace_back([&, i] {
        res[i] = Complete(*router, Request(prompts[i], /*stream=*/true), absl::Seconds(120));
      });
    }
    const bool busy = WaitFor(
        [&] {
          absl::StatusOr<json> h = GetJson(servers["d1"], "/health");
          return h.ok() && (*h)["active_requests"].get<int>() > 0;
        },
        absl::Seconds(30));
    d.Kill("d1");
    for (std::thread& t : threads) t.join();
    ASSERT_TRUE(busy) << d.Logs();
    int failed = 0;
    for (size_t i = 0; i < res.size(); ++i) {
      ASSERT_TRUE(res[i].ok()) << res[i].status();
      if (res[i]->status == 200 && res[i]->error.empty()) {
        EXPECT_EQ(res[i]->tokens, want[i]) << "prompt " << i;
        EXPECT_EQ(res[i]->kvwire.value("engine_id", ""), "d2");
      } else {
        ++failed;
        EXPECT_FALSE(res[i]->error.empty());
        EXPECT_FALSE(res[i]->done) << "a failed stream must not end with [DONE]";
      }
    }
    EXPECT_GE(failed, 1) << "no request was on the killed decode";
  }
  // Its key expires with its 2 s lease; the router drops it.
  EXPECT_TRUE(WaitFor([&] { return Instances(*router, "decode") == 1; }, absl::Seconds(15)))
      << d.Logs();

  // 3. A replacement registers and takes the next requests.
  absl::StatusOr<std::string> d3 = d.Serve("d3", "decode", transport);
  ASSERT_TRUE(d3.ok()) << d3.status();
  servers["d3"] = *d3;
  ASSERT_TRUE(WaitFor([&] { return Instances(*router, "decode") == 2; }, absl::Seconds(10)));
  {
    std::vector<json> reqs;
    for (size_t i = 0; i < 4; ++i) reqs.push_back(Request(prompts[i], i % 2 == 1));
    std::vector<absl::StatusOr<CompletionResult>> res = SendAll(*router, reqs);
    for (size_t i = 0; i < res.size(); ++i) expect_match(res[i], i);
    EXPECT_GT(Routed(*router, "decode", "d3"), 0) << "the replacement decode got no request";
  }

  // 4. etcd goes away: the router keeps its last list, and the instances keep serving in
  // both modes (read mode carries prefill's address; in write mode the router names the
  // prefill by the kv address it reports, as a decode that never met it cannot resolve it).
  (*etcd)->Kill(0);
  {
    absl::StatusOr<json> h;
    EXPECT_TRUE(WaitFor(
        [&] {
          h = GetJson(*router, "/health");
          return h.ok() && !(*h).value("etcd_connected", true);
        },
        absl::Seconds(30)));
    EXPECT_EQ(Instances(*router, "decode"), 2u);
    pushers.clear();
    for (const char* name : {"p1", "p2"}) {
      absl::StatusOr<json> ph = GetJson(servers[name], "/health");
      ASSERT_TRUE(ph.ok()) << name << ": " << ph.status();
      pushers.insert(ph->value("kv_address", ""));
    }
    std::vector<json> reqs;
    for (size_t i = 0; i < 4; ++i) reqs.push_back(Request(prompts[i], i % 2 == 0));
    std::vector<absl::StatusOr<CompletionResult>> res = SendAll(*router, reqs);
    for (size_t i = 0; i < res.size(); ++i) expect_match(res[i], i);
  }

  for (const char* name : {"p1", "p2", "d2", "d3"}) ExpectDrained(servers[name], name);
}

INSTANTIATE_TEST_SUITE_P(Transports, XpydTest,
                         ::testing::Values(Param{"tcp", "read"}, Param{"shm", "write"}),
                         [](const ::testing::TestParamInfo<Param>& p) {
                           return absl::StrCat(p.param.transport, "_", p.param.mode);
                         });

}  // namespace
}  // namespace dsv4::serve
