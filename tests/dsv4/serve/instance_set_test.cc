// The router's instance set without etcd: least_loaded follows the load the instances report
// on GET /health (real HTTP servers here) and the requests the router has in flight on them;
// round_robin takes them in turn; every choice is counted in the metrics.
#include "examples/dsv4/serve/instance_set.h"

#include <atomic>
#include <functional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/http_server.h"

namespace dsv4::serve {
namespace {

using nlohmann::json;

// An instance that reports `active` requests in flight and `used` of 100 blocks.
class FakeInstance {
 public:
  FakeInstance() {
    absl::StatusOr<std::unique_ptr<HttpServer>> s =
        HttpServer::Start({}, [this](const HttpRequest&, std::shared_ptr<Responder> r) {
          r->Respond(200, json{{"active_requests", active.load()},
                               {"prefilling", 0},
                               {"used_blocks", used.load()},
                               {"total_blocks", 100}}
                              .dump());
        });
    EXPECT_TRUE(s.ok()) << s.status();
    server = std::move(*s);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", server->port()); }
  std::atomic<int> active{0}, used{0};
  std::unique_ptr<HttpServer> server;
};

bool WaitFor(const std::function<bool()>& pred) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return pred();
}

TEST(InstanceSet, LeastLoadedFollowsReportedAndOutstandingLoad) {
  FakeInstance busy, idle, prefill;
  busy.active = 3;
  InstanceSetOptions o;
  o.prefill = {prefill.address()};
  o.decode = {busy.address(), idle.address()};
  o.policy = "least_loaded";
  o.poll = absl::Milliseconds(20);
  absl::StatusOr<std::unique_ptr<InstanceSet>> set = InstanceSet::Start(o);
  ASSERT_TRUE(set.ok()) << set.status();
  InstanceSet& s = **set;
  ASSERT_TRUE(WaitFor([&] {
    return s.Metrics().find("reported_active{kind=\"decode\",instance=\"" + busy.address() +
                            "\"} 3\n") != std::string::npos;
  })) << s.Metrics();
  // The reported load decides, whatever the rotation.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(s.Order(InstanceKind::kDecode)[0], idle.address());
  // Four requests in flight from this router outweigh the busy one's three.
  std::vector<InstanceSet::Ticket> held;
  for (int i = 0; i < 4; ++i) held.push_back(s.Acquire(InstanceKind::kDecode, idle.address()));
  EXPECT_EQ(s.Order(InstanceKind::kDecode)[0], busy.address());
  held.clear();
  EXPECT_EQ(s.Order(InstanceKind::kDecode)[0], idle.address());
  // Equal load: the one with more free blocks.
  busy.active = 0;
  idle.used = 90;
  ASSERT_TRUE(WaitFor([&] {
    return s.Metrics().find("free_blocks{kind=\"decode\",instance=\"" + idle.address() +
                            "\"} 10\n") != std::string::npos &&
           s.Metrics().find("reported_active{kind=\"decode\",instance=\"" + busy.address() +
                            "\"} 0\n") != std::string::npos;
  })) << s.Metrics();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(s.Order(InstanceKind::kDecode)[0], busy.address());
  // An instance that stops answering goes last (its reported load reads -1 once polled).
  idle.used = 0;
  const std::string gone = busy.address();
  busy.server.reset();
  ASSERT_TRUE(WaitFor([&] {
    return s.Metrics().find("reported_active{kind=\"decode\",instance=\"" + gone + "\"} -1\n") !=
           std::string::npos;
  })) << s.Metrics();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s.Order(InstanceKind::kDecode)[0], idle.address()) << s.Metrics();
  }
  const std::string m = s.Metrics();
  EXPECT_NE(m.find(absl::StrCat("kvwire_dsv4_router_routed_total{kind=\"decode\",instance=\"",
                                idle.address(), "\",policy=\"least_loaded\"} 4")),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("kvwire_dsv4_router_instances{kind=\"decode\"} 2"), std::string::npos) << m;
  EXPECT_EQ(s.Health()["policy"], "least_loaded");
}

TEST(InstanceSet, RoundRobinTakesTurnsAndOptionsAreChecked) {
  InstanceSetOptions o;
  o.prefill = {"127.0.0.1:1"};
  // Listed out of address order: the turns follow the command line, not the sort.
  o.decode = {"127.0.0.1:3", "127.0.0.1:2"};
  absl::StatusOr<std::unique_ptr<InstanceSet>> set = InstanceSet::Start(o);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*set)->policy(), "round_robin");
  EXPECT_EQ((*set)->Order(InstanceKind::kDecode),
            (std::vector<std::string>{"127.0.0.1:3", "127.0.0.1:2"}));
  EXPECT_EQ((*set)->Order(InstanceKind::kDecode),
            (std::vector<std::string>{"127.0.0.1:2", "127.0.0.1:3"}));
  EXPECT_EQ((*set)->Order(InstanceKind::kDecode)[0], "127.0.0.1:3");
  o.policy = "fastest";
  EXPECT_FALSE(InstanceSet::Start(o).ok());
  o.policy = "";
  o.decode = {"nohost"};
  EXPECT_FALSE(InstanceSet::Start(o).ok());
  o.decode = {};
  EXPECT_FALSE(InstanceSet::Start(o).ok());
  o.decode = {"127.0.0.1:2"};
  o.etcd = "http://127.0.0.1:1";
  o.cluster = "c";
  EXPECT_FALSE(InstanceSet::Start(o).ok()) << "--etcd with fixed lists";
  o.prefill = o.decode = {};
  o.cluster = "a/b";
  EXPECT_FALSE(InstanceSet::Start(o).ok()) << "bad cluster name";
}

}  // namespace
}  // namespace dsv4::serve
