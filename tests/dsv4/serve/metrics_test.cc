// Every /metrics the project serves passes `promtool check metrics` (exit status 0 and no
// finding) after real traffic:
// - the kvwire-dsv4 reference servers (a prefill and a decode process): their own
//   kvwire_dsv4_* series, the admission queue's, and the connector's and the engine's
//   expositions they include (the engine has no endpoint of its own; engine_stats_output_test
//   checks its exposition alone);
// - the routers in front of them (read and write mode), with their per-instance series;
// - a connector's own endpoint (ConnectorOptions::metrics_address, the one the vLLM plugin's
//   metrics_address serves).
// The decode server's engine name has a quote and a backslash, which its label values must
// escape. promtool comes from Debian's prometheus package (scripts/install-deps.sh); a missing
// promtool fails the test (tests/support/promtool.h).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/http_client.h"
#include "kvwire/connector.h"
#include "tests/dsv4/serve/serve_cluster.h"
#include "tests/support/promtool.h"

namespace dsv4::serve {
namespace {

using test_support::ServeCluster;

// GET /metrics of `address`: its body, or a failure naming what answered.
absl::StatusOr<std::string> MetricsOf(const std::string& address) {
  HttpCallOptions o;
  o.deadline = absl::Now() + absl::Seconds(30);
  absl::StatusOr<HttpResponse> r = HttpCall(address, "GET", "/metrics", "", o);
  if (!r.ok()) return r.status();
  if (r->status != 200) {
    return absl::InternalError(
        absl::StrCat(address, " /metrics answered ", r->status, ": ", r->body.substr(0, 300)));
  }
  return r->body;
}

void ExpectPromtoolAccepts(const std::string& what, const std::string& address) {
  absl::StatusOr<std::string> m = MetricsOf(address);
  ASSERT_TRUE(m.ok()) << what << ": " << m.status();
  const absl::Status s = kvwire::testing::PromtoolCheckMetrics(*m);
  EXPECT_TRUE(s.ok()) << what << " (" << address << "): " << s.message();
}

TEST(MetricsTest, EveryMetricsEndpointPassesPromtool) {
  ServeCluster c;
  ASSERT_TRUE(c.MakeWeights().ok());
  absl::StatusOr<std::string> prefill = c.Serve("prefill", "prefill", "tcp");
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  absl::StatusOr<std::string> decode =
      c.Serve("decode", "decode", "tcp", {"--name", "decode \"q\" \\b"});
  ASSERT_TRUE(decode.ok()) << decode.status();
  absl::StatusOr<std::string> read_router = c.Router("router-read", *prefill, *decode, "read");
  ASSERT_TRUE(read_router.ok()) << read_router.status();
  absl::StatusOr<std::string> write_router = c.Router("router-write", *prefill, *decode, "write");
  ASSERT_TRUE(write_router.ok()) << write_router.status();

  // Real traffic through both modes, so that every family has samples (the transfer
  // histograms, the admission wait, the routers' per-instance series).
  for (const std::string& router : {*read_router, *write_router}) {
    HttpCallOptions o;
    o.deadline = absl::Now() + absl::Seconds(120);
    absl::StatusOr<HttpResponse> r = HttpCall(
        router, "POST", "/v1/completions", R"({"prompt": "metrics, please", "max_tokens": 4})", o);
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << c.Logs();
    ASSERT_EQ(r->status, 200) << r->body << "\n" << c.Logs();
  }

  ExpectPromtoolAccepts("prefill server", *prefill);
  ExpectPromtoolAccepts("decode server", *decode);
  ExpectPromtoolAccepts("read-mode router", *read_router);
  ExpectPromtoolAccepts("write-mode router", *write_router);
  absl::StatusOr<std::string> d = MetricsOf(*decode);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_NE(d->find("kvwire_dsv4_generated_tokens_total{engine=\"decode \\\"q\\\" \\\\b\"}"),
            std::string::npos)
      << *d;

  // A connector's own endpoint.
  kvwire::ConnectorOptions co;
  co.role = "decode";
  co.engine.name = "metrics \"q\" \\b";
  co.engine.listen_address = "127.0.0.1:0";
  co.metrics_address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<kvwire::Connector>> connector = kvwire::Connector::Create(co);
  ASSERT_TRUE(connector.ok()) << connector.status();
  ASSERT_FALSE((*connector)->metrics_address().empty());
  ExpectPromtoolAccepts("connector", (*connector)->metrics_address());
}

}  // namespace
}  // namespace dsv4::serve
