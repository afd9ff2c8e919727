#include "kvwire/stats.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "src/util/json_escape.h"
#include "src/util/prometheus_text.h"

namespace kvwire {

void LatencyHistogram::Add(double us) {
  int bucket = 0;
  if (us >= 0x1p62) {
    bucket = kBuckets - 1;
  } else if (us >= 1) {
    // 1 + floor(log2(us)), from the integer part's bit width (floor(log2) of a value >= 1 is
    // that of its integer part): a libm log2 per transfer cost ~50 instructions.
    bucket = std::min(kBuckets - 1, static_cast<int>(std::bit_width(static_cast<uint64_t>(us))));
  }
  ++counts[bucket];
  ++samples;
  sum_us += us;
  max_us = std::max(max_us, us);
}

double LatencyHistogram::QuantileUpperBoundUs(double q) const {
  if (samples == 0) return 0;
  const uint64_t rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(samples)));
  uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += counts[i];
    if (seen >= std::max<uint64_t>(rank, 1)) {
      return i == kBuckets - 1 ? max_us : std::ldexp(1.0, i);
    }
  }
  return max_us;
}

const TransportStat* EngineStats::FindTransportStat(std::string_view group,
                                                    std::string_view name) const {
  for (const TransportStat& stat : transport_stats) {
    if (stat.group == group && stat.name == name) return &stat;
  }
  return nullptr;
}

uint64_t EngineStats::TransportStatValue(std::string_view group, std::string_view name) const {
  const TransportStat* stat = FindTransportStat(group, name);
  return stat != nullptr ? stat->value : 0;
}

std::string EngineStats::ToJson() const {
  std::string out = absl::StrCat(
      "{\"regions\":", regions, ",\"registered_bytes\":", registered_bytes,
      ",\"registration_us_total\":", registration_us_total, ",\"bytes_read\":", bytes_read,
      ",\"bytes_written\":", bytes_written, ",\"ops_submitted\":", ops_submitted,
      ",\"ops_posted\":", ops_posted, ",\"transfers_started\":", transfers_started,
      ",\"transfers_succeeded\":", transfers_succeeded, ",\"transfers_failed\":", transfers_failed,
      ",\"notifications_sent\":", notifications_sent,
      ",\"notifications_delivered\":", notifications_delivered, ",\"incoming_ops\":", incoming_ops,
      ",\"incoming_rejected\":", incoming_rejected, ",\"grant_refused\":", grant_refused,
      ",\"grants_live\":", grants_live,
      ",\"control\":{\"handshakes_in_flight\":", control.handshakes_in_flight,
      ",\"connections\":", control.control_connections,
      ",\"handshakes_failed\":", control.handshakes_failed,
      ",\"handshakes_refused\":", control.handshakes_refused,
      ",\"session_tokens\":", control.session_tokens,
      ",\"notifications_dropped\":", control.notifications_dropped,
      ",\"peers_closed_for_protocol\":", control.peers_closed_for_protocol, "}",
      ",\"transfer_latency_us\":{\"samples\":", transfer_latency.samples, ",\"avg\":",
      transfer_latency.samples ? transfer_latency.sum_us / transfer_latency.samples : 0,
      ",\"p50_le\":", transfer_latency.QuantileUpperBoundUs(0.5),
      ",\"p99_le\":", transfer_latency.QuantileUpperBoundUs(0.99),
      ",\"max\":", transfer_latency.max_us, "},\"errors_by_kind\":{");
  bool first = true;
  for (const auto& [kind, count] : errors_by_kind) {
    absl::StrAppend(&out, first ? "" : ",", "\"", JsonEscape(kind), "\":", count);
    first = false;
  }
  absl::StrAppend(&out, "},\"peers\":[");
  first = true;
  for (const PeerStats& p : peers) {
    absl::StrAppend(&out, first ? "" : ",", "{\"id\":", p.peer_id, ",\"name\":\"",
                    JsonEscape(p.name), "\",\"transport\":\"", JsonEscape(p.transport),
                    "\",\"transport_reason\":\"", JsonEscape(p.transport_reason),
                    "\",\"alive\":", p.alive ? "true" : "false", ",\"bytes_read\":", p.bytes_read,
                    ",\"bytes_written\":", p.bytes_written, ",\"transfers\":", p.transfers, "}");
    first = false;
  }
  absl::StrAppend(&out, "]");
  // The transports' statistics, by group in the order they first appear; "gpu" is also the
  // engine's (its regions come first).
  std::vector<std::string> groups;
  for (const TransportStat& stat : transport_stats) {
    if (std::find(groups.begin(), groups.end(), stat.group) == groups.end()) {
      groups.push_back(stat.group);
    }
  }
  if (std::find(groups.begin(), groups.end(), "gpu") == groups.end()) groups.push_back("gpu");
  for (const std::string& group : groups) {
    absl::StrAppend(&out, ",\"", JsonEscape(group), "\":{");
    first = true;
    if (group == "gpu") {
      absl::StrAppend(&out, "\"regions\":", gpu.regions);
      first = false;
    }
    for (const TransportStat& stat : transport_stats) {
      if (stat.group != group) continue;
      absl::StrAppend(&out, first ? "" : ",", "\"", JsonEscape(stat.name), "\":");
      if (stat.kind == TransportStat::Kind::kText) {
        absl::StrAppend(&out, "\"", JsonEscape(stat.text), "\"");
      } else {
        absl::StrAppend(&out, stat.value);
      }
      first = false;
    }
    absl::StrAppend(&out, "}");
  }
  absl::StrAppend(&out, "}");
  return out;
}

std::string EngineStats::ToPrometheus(const std::string& engine_name) const {
  const std::string label = absl::StrCat("engine=\"", PrometheusLabelValue(engine_name), "\"");
  std::string out;
  // Values are integers: written exactly (a double's six significant digits would round
  // a byte counter).
  auto metric = [&](const char* type, const char* name, const char* help, uint64_t value) {
    absl::StrAppend(&out, "# HELP kvwire_", name, " ", help, "\n# TYPE kvwire_", name, " ", type,
                    "\nkvwire_", name, "{", label, "} ", value, "\n");
  };
  auto counter = [&](const char* name, const char* help, uint64_t value) {
    metric("counter", name, help, value);
  };
  auto gauge = [&](const char* name, const char* help, uint64_t value) {
    metric("gauge", name, help, value);
  };
  counter("bytes_read_total", "Bytes moved by completed READ transfers.", bytes_read);
  counter("bytes_written_total", "Bytes moved by completed WRITE transfers.", bytes_written);
  counter("ops_submitted_total", "Ops given to Transfer.", ops_submitted);
  counter("ops_posted_total", "Ops on the wire after merging and splitting.", ops_posted);
  counter("transfers_succeeded_total", "Transfers that succeeded.", transfers_succeeded);
  counter("transfers_failed_total", "Transfers that failed.", transfers_failed);
  counter("notifications_delivered_total", "Notifications delivered.", notifications_delivered);
  counter("incoming_ops_total", "Ops served as a target.", incoming_ops);
  counter("incoming_rejected_total", "Incoming ops refused by validation.", incoming_rejected);
  counter("grant_refused_total",
          "Incoming READs of grant-guarded regions refused for want of a live grant.",
          grant_refused);
  gauge("grants_live", "Read grants live (Engine::Grant, not yet revoked).", grants_live);
  // The transports' metrics in the order they list them; the engine's GPU region gauge goes
  // with the first of group "gpu".
  bool gpu_regions_done = false;
  const auto gpu_regions = [&] {
    if (gpu_regions_done) return;
    gauge("gpu_regions", "GPU memory regions registered.", gpu.regions);
    gpu_regions_done = true;
  };
  for (const TransportStat& stat : transport_stats) {
    if (stat.metric.empty() || stat.kind == TransportStat::Kind::kText) continue;
    if (stat.group == "gpu") gpu_regions();
    metric(stat.kind == TransportStat::Kind::kGauge ? "gauge" : "counter", stat.metric.c_str(),
           stat.help.c_str(), stat.value);
  }
  gpu_regions();
  gauge("control_handshakes_in_flight", "Inbound control handshakes not yet authenticated.",
        control.handshakes_in_flight);
  gauge("control_connections", "Inbound control connections open.", control.control_connections);
  counter("control_handshakes_failed_total", "Inbound control handshakes that failed.",
          control.handshakes_failed);
  counter("control_handshakes_refused_total", "Dialers refused over a control-port limit.",
          control.handshakes_refused);
  gauge("control_session_tokens", "Live session tokens.", control.session_tokens);
  counter("control_notifications_dropped_total", "Notifications dropped: consumer not taking.",
          control.notifications_dropped);
  counter("control_peers_closed_for_protocol_total",
          "Peers closed for a malformed/unknown control message or an overrun queue.",
          control.peers_closed_for_protocol);
  // Latency in seconds, as Prometheus names and measures it; the buckets are the histogram's
  // power-of-two microsecond bounds.
  absl::StrAppend(&out,
                  "# HELP kvwire_transfer_latency_seconds Transfer latency, from Transfer to "
                  "completion.\n",
                  "# TYPE kvwire_transfer_latency_seconds histogram\n");
  uint64_t cumulative = 0;
  for (int i = 0; i < LatencyHistogram::kBuckets - 1; ++i) {
    cumulative += transfer_latency.counts[i];
    absl::StrAppend(&out, "kvwire_transfer_latency_seconds_bucket{", label, ",le=\"",
                    PrometheusNumber(std::ldexp(1.0, i) / 1e6), "\"} ", cumulative, "\n");
  }
  absl::StrAppend(&out, "kvwire_transfer_latency_seconds_bucket{", label, ",le=\"+Inf\"} ",
                  transfer_latency.samples, "\n", "kvwire_transfer_latency_seconds_sum{", label,
                  "} ", PrometheusNumber(transfer_latency.sum_us / 1e6), "\n",
                  "kvwire_transfer_latency_seconds_count{", label, "} ", transfer_latency.samples,
                  "\n");
  absl::StrAppend(&out, "# HELP kvwire_errors_total Failed transfers by status code.\n",
                  "# TYPE kvwire_errors_total counter\n");
  for (const auto& [kind, count] : errors_by_kind) {
    absl::StrAppend(&out, "kvwire_errors_total{", label, ",kind=\"", PrometheusLabelValue(kind),
                    "\"} ", count, "\n");
  }
  absl::StrAppend(&out,
                  "# HELP kvwire_peer_info A peer and its transport: 1 while alive, 0 after.\n",
                  "# TYPE kvwire_peer_info gauge\n");
  for (const PeerStats& p : peers) {
    absl::StrAppend(&out, "kvwire_peer_info{", label, ",peer=\"", PrometheusLabelValue(p.name),
                    "\",transport=\"", PrometheusLabelValue(p.transport), "\"} ", p.alive ? 1 : 0,
                    "\n");
  }
  return out;
}

}  // namespace kvwire
