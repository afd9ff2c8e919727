// The engine's stats output (EngineStats::ToJson and ::ToPrometheus) after real traffic
// between two engines on loopback: the names it carries are pinned here, so that a change in
// how transports report their statistics cannot rename, drop or retype a metric unnoticed.
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#include "kvwire/engine.h"
#include "kvwire/stats.h"
#include "tests/integration/test_pattern.h"
#include "tests/support/promtool.h"

namespace kvwire::testing {
namespace {

constexpr uint64_t kBytes = 64 << 10;
// The dialer's name, which the other engine shows as a peer label: a quote, a backslash and
// a line feed, each of which must be escaped in the Prometheus output.
constexpr char kNameA[] = "stats-a \"q\" \\b\nc";

std::unique_ptr<Engine> MakeEngine(const std::string& name, const std::string& transport) {
  EngineOptions options;
  options.name = name;
  options.transport = transport;
  auto engine = Engine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// Two engines on tcp: `a` dials `b` and exports its region; `b` WRITEs and READs kBytes to
// and from it.
class EngineStatsOutputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FillPattern(source_.data(), source_.size(), 7, 0);
    a_ = MakeEngine(kNameA, "tcp");
    b_ = MakeEngine("stats-b", "tcp");
    ASSERT_TRUE(a_ && b_);
    auto remote = a_->RegisterMemory(target_.data(), target_.size());
    auto local = b_->RegisterMemory(source_.data(), source_.size());
    ASSERT_TRUE(local.ok() && remote.ok());
    ConnectOptions connect;
    connect.exports = {*remote};
    ASSERT_TRUE(a_->Connect(b_->address(), connect).ok());
    auto peer = b_->WaitForPeer(kNameA, absl::Seconds(10));
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE(b_->WaitForRemoteRegion(*peer, *remote, absl::Seconds(10)).ok());
    for (OpKind kind : {OpKind::kWrite, OpKind::kRead}) {
      auto id = b_->Transfer(*peer, kind, {Op{*local, 0, *remote, 0, kBytes}});
      ASSERT_TRUE(id.ok()) << id.status();
      ASSERT_TRUE(b_->Wait(*id, absl::Seconds(30)).ok());
    }
    ASSERT_EQ(FirstDifference(source_.data(), target_.data(), kBytes), -1);
  }

  // Region memory outlives both engines (declared first).
  std::vector<std::byte> source_ = std::vector<std::byte>(kBytes);
  std::vector<std::byte> target_ = std::vector<std::byte>(kBytes);
  std::unique_ptr<Engine> a_;
  std::unique_ptr<Engine> b_;
};

// Every leaf of `j` as "path": objects by key, arrays as "[]".
void Flatten(const nlohmann::json& j, const std::string& path,
             std::map<std::string, nlohmann::json>* out) {
  if (j.is_object()) {
    for (const auto& [key, value] : j.items()) {
      Flatten(value, path.empty() ? key : path + "." + key, out);
    }
  } else if (j.is_array()) {
    for (const auto& value : j) Flatten(value, path + "[]", out);
  } else {
    (*out)[path] = j;
  }
}

// Prometheus text: family name -> TYPE, and each sample's name -> its value (the first
// sample of that name; labels dropped).
struct Exposition {
  std::map<std::string, std::string> types;
  std::map<std::string, double> values;
};

Exposition ParseExposition(const std::string& text) {
  Exposition e;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      if (parts.size() == 2) e.types[parts[0]] = parts[1];
      continue;
    }
    if (absl::StartsWith(line, "#")) continue;
    const size_t name_end = std::min(line.find('{'), line.find(' '));
    const std::string name(line.substr(0, name_end));
    const size_t value_at = line.rfind(' ');
    if (!e.values.count(name)) e.values[name] = std::stod(std::string(line.substr(value_at + 1)));
  }
  return e;
}

std::string Keys(const std::map<std::string, nlohmann::json>& m) {
  std::string out;
  for (const auto& [k, v] : m) out += k + "\n";
  return out;
}

TEST_F(EngineStatsOutputTest, JsonCarriesEveryPinnedField) {
  const nlohmann::json j = nlohmann::json::parse(b_->Stats().ToJson());
  std::map<std::string, nlohmann::json> leaves;
  Flatten(j, "", &leaves);
  const std::set<std::string> expected = {"bytes_by_transport.rdma_read",
                                          "bytes_by_transport.rdma_written",
                                          "bytes_by_transport.shm_read",
                                          "bytes_by_transport.shm_written",
                                          "bytes_by_transport.tcp_read",
                                          "bytes_by_transport.tcp_written",
                                          "bytes_read",
                                          "bytes_written",
                                          "control.connections",
                                          "control.handshakes_failed",
                                          "control.handshakes_in_flight",
                                          "control.handshakes_refused",
                                          "control.notifications_dropped",
                                          "control.peers_closed_for_protocol",
                                          "control.session_tokens",
                                          "gpu.rdma_dmabuf_regions",
                                          "gpu.rdma_path_reason",
                                          "gpu.rdma_peermem_regions",
                                          "gpu.regions",
                                          "gpu.shm_device_copies",
                                          "gpu.shm_ipc_opens",
                                          "gpu.tcp_staged_bytes",
                                          "grant_refused",
                                          "grants_live",
                                          "incoming_ops",
                                          "incoming_rejected",
                                          "notifications_delivered",
                                          "notifications_sent",
                                          "ops_posted",
                                          "ops_submitted",
                                          "peers[].alive",
                                          "peers[].bytes_read",
                                          "peers[].bytes_written",
                                          "peers[].id",
                                          "peers[].name",
                                          "peers[].transfers",
                                          "peers[].transport",
                                          "peers[].transport_reason",
                                          "rdma.async_events",
                                          "rdma.completion_errors",
                                          "rdma.inline_wrs",
                                          "rdma.post_calls",
                                          "rdma.qp_reconnects",
                                          "rdma.queued_wrs",
                                          "rdma.signalled",
                                          "rdma.work_requests",
                                          "registered_bytes",
                                          "regions",
                                          "registration_us_total",
                                          "shm.served_copy_bytes",
                                          "shm.served_copy_bytes_answered",
                                          "shm.served_copy_requests",
                                          "shm.served_copy_requests_answered",
                                          "shm.served_copy_requests_refused",
                                          "tcp_listener.connections",
                                          "tcp_listener.hello_refused",
                                          "tcp_listener.hello_timeouts",
                                          "tcp_listener.refused_over_limit",
                                          "tcp_listener.stalled_dropped",
                                          "tcp_listener.thread_failures",
                                          "transfer_latency_us.avg",
                                          "transfer_latency_us.max",
                                          "transfer_latency_us.p50_le",
                                          "transfer_latency_us.p99_le",
                                          "transfer_latency_us.samples",
                                          "transfers_failed",
                                          "transfers_started",
                                          "transfers_succeeded"};
  std::set<std::string> got;
  for (const auto& [k, v] : leaves) got.insert(k);
  EXPECT_EQ(got, expected) << Keys(leaves);
  // The values travel: what this test moved, and zeros for what it did not use.
  EXPECT_EQ(leaves["bytes_written"], kBytes);
  EXPECT_EQ(leaves["bytes_read"], kBytes);
  // ... and over which transport they moved.
  EXPECT_EQ(leaves["bytes_by_transport.tcp_read"], kBytes);
  EXPECT_EQ(leaves["bytes_by_transport.tcp_written"], kBytes);
  EXPECT_EQ(leaves["bytes_by_transport.shm_read"], 0);
  EXPECT_EQ(leaves["bytes_by_transport.rdma_written"], 0);
  EXPECT_EQ(leaves["transfers_succeeded"], 2);
  EXPECT_EQ(leaves["rdma.work_requests"], 0);
  EXPECT_EQ(leaves["gpu.tcp_staged_bytes"], 0);
  EXPECT_EQ(leaves["gpu.rdma_path_reason"], "");
  EXPECT_TRUE(leaves["tcp_listener.connections"].is_number_unsigned());
  // The target served both ops over its tcp listener.
  const nlohmann::json jb = nlohmann::json::parse(a_->Stats().ToJson());
  EXPECT_EQ(jb["incoming_ops"], 2);
  EXPECT_GE(jb["tcp_listener"]["connections"].get<uint64_t>(), 1u);
}

TEST_F(EngineStatsOutputTest, PrometheusCarriesEveryPinnedMetric) {
  const Exposition e = ParseExposition(b_->Stats().ToPrometheus("stats-b"));
  const std::map<std::string, std::string> expected = {
      {"kvwire_bytes_read_total", "counter"},
      {"kvwire_bytes_written_total", "counter"},
      {"kvwire_control_connections", "gauge"},
      {"kvwire_control_handshakes_failed_total", "counter"},
      {"kvwire_control_handshakes_in_flight", "gauge"},
      {"kvwire_control_handshakes_refused_total", "counter"},
      {"kvwire_control_notifications_dropped_total", "counter"},
      {"kvwire_control_peers_closed_for_protocol_total", "counter"},
      {"kvwire_control_session_tokens", "gauge"},
      {"kvwire_errors_total", "counter"},
      {"kvwire_gpu_rdma_dmabuf_regions_total", "counter"},
      {"kvwire_gpu_rdma_peermem_regions_total", "counter"},
      {"kvwire_gpu_regions", "gauge"},
      {"kvwire_gpu_shm_device_copies_total", "counter"},
      {"kvwire_gpu_shm_ipc_opens_total", "counter"},
      {"kvwire_gpu_tcp_staged_bytes_total", "counter"},
      {"kvwire_grant_refused_total", "counter"},
      {"kvwire_grants_live", "gauge"},
      {"kvwire_incoming_ops_total", "counter"},
      {"kvwire_incoming_rejected_total", "counter"},
      {"kvwire_notifications_delivered_total", "counter"},
      {"kvwire_ops_posted_total", "counter"},
      {"kvwire_ops_submitted_total", "counter"},
      {"kvwire_peer_info", "gauge"},
      {"kvwire_rdma_async_events_total", "counter"},
      {"kvwire_rdma_bytes_read_total", "counter"},
      {"kvwire_rdma_bytes_written_total", "counter"},
      {"kvwire_rdma_completion_errors_total", "counter"},
      {"kvwire_rdma_inline_total", "counter"},
      {"kvwire_rdma_post_calls_total", "counter"},
      {"kvwire_rdma_qp_reconnects_total", "counter"},
      {"kvwire_rdma_queued_total", "counter"},
      {"kvwire_rdma_signalled_total", "counter"},
      {"kvwire_rdma_work_requests_total", "counter"},
      {"kvwire_shm_bytes_read_total", "counter"},
      {"kvwire_shm_bytes_written_total", "counter"},
      {"kvwire_shm_served_copy_bytes_answered_total", "counter"},
      {"kvwire_shm_served_copy_bytes_total", "counter"},
      {"kvwire_shm_served_copy_requests_answered_total", "counter"},
      {"kvwire_shm_served_copy_requests_refused_total", "counter"},
      {"kvwire_shm_served_copy_requests_total", "counter"},
      {"kvwire_tcp_bytes_read_total", "counter"},
      {"kvwire_tcp_bytes_written_total", "counter"},
      {"kvwire_tcp_data_connections", "gauge"},
      {"kvwire_tcp_hello_refused_total", "counter"},
      {"kvwire_tcp_hello_timeouts_total", "counter"},
      {"kvwire_tcp_refused_over_limit_total", "counter"},
      {"kvwire_tcp_stalled_dropped_total", "counter"},
      {"kvwire_tcp_thread_failures_total", "counter"},
      {"kvwire_transfer_latency_seconds", "histogram"},
      {"kvwire_transfers_failed_total", "counter"},
      {"kvwire_transfers_succeeded_total", "counter"},
  };
  EXPECT_EQ(e.types, expected);
  EXPECT_EQ(e.values.at("kvwire_bytes_written_total"), kBytes);
  EXPECT_EQ(e.values.at("kvwire_tcp_bytes_written_total"), kBytes);
  EXPECT_EQ(e.values.at("kvwire_tcp_bytes_read_total"), kBytes);
  EXPECT_EQ(e.values.at("kvwire_shm_bytes_written_total"), 0);
  EXPECT_EQ(e.values.at("kvwire_rdma_work_requests_total"), 0);
  EXPECT_EQ(e.values.at("kvwire_gpu_tcp_staged_bytes_total"), 0);
  EXPECT_EQ(e.values.at("kvwire_transfer_latency_seconds_count"), 2);
  EXPECT_EQ(e.values.at("kvwire_peer_info"), 1);
  const Exposition eb = ParseExposition(a_->Stats().ToPrometheus(kNameA));
  EXPECT_EQ(eb.values.at("kvwire_incoming_ops_total"), 2);
  EXPECT_GE(eb.values.at("kvwire_tcp_data_connections"), 1);
}

// Prometheus's own linter accepts both engines' output after real traffic: types, names
// (latency in seconds), HELP lines, and label values with a quote, a backslash, a line feed.
TEST_F(EngineStatsOutputTest, PrometheusPassesPromtool) {
  const std::string initiator = b_->Stats().ToPrometheus("stats-b");
  const absl::Status b = PromtoolCheckMetrics(initiator);
  EXPECT_TRUE(b.ok()) << b.message();
  const absl::Status a = PromtoolCheckMetrics(a_->Stats().ToPrometheus(kNameA));
  EXPECT_TRUE(a.ok()) << a.message();
  EXPECT_NE(initiator.find("peer=\"stats-a \\\"q\\\" \\\\b\\nc\""), std::string::npos) << initiator;
  // Both transfers are counted, in seconds: the sum is a small fraction, not microseconds.
  const Exposition e = ParseExposition(initiator);
  EXPECT_EQ(e.values.at("kvwire_transfer_latency_seconds_count"), 2);
  EXPECT_LT(e.values.at("kvwire_transfer_latency_seconds_sum"), 60);
  EXPECT_EQ(e.values.at("kvwire_transfer_latency_seconds_bucket"), 0);  // le="1e-06"
}

}  // namespace
}  // namespace kvwire::testing
