#include "kvwire/stats.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "src/util/json_escape.h"

namespace kvwire {

void LatencyHistogram::Add(double us) {
  int bucket = 0;
  if (us >= 1) bucket = std::min(kBuckets - 1, 1 + static_cast<int>(std::floor(std::log2(us))));
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

std::string EngineStats::ToJson() const {
  std::string out = absl::StrCat(
      "{\"regions\":", regions, ",\"registered_bytes\":", registered_bytes,
      ",\"registration_us_total\":", registration_us_total, ",\"bytes_read\":", bytes_read,
      ",\"bytes_written\":", bytes_written, ",\"ops_submitted\":", ops_submitted,
      ",\"ops_posted\":", ops_posted, ",\"transfers_started\":", transfers_started,
      ",\"transfers_succeeded\":", transfers_succeeded, ",\"transfers_failed\":", transfers_failed,
      ",\"notifications_sent\":", notifications_sent,
      ",\"notifications_delivered\":", notifications_delivered, ",\"incoming_ops\":", incoming_ops,
      ",\"incoming_rejected\":", incoming_rejected,
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
  absl::StrAppend(
      &out, "],\"rdma\":{\"work_requests\":", rdma.work_requests,
      ",\"post_calls\":", rdma.post_calls, ",\"signalled\":", rdma.signalled,
      ",\"inline_wrs\":", rdma.inline_wrs, ",\"queued_wrs\":", rdma.queued_wrs,
      ",\"completion_errors\":", rdma.completion_errors, ",\"async_events\":", rdma.async_events,
      ",\"qp_reconnects\":", rdma.qp_reconnects, "},\"gpu\":{\"regions\":", gpu.regions,
      ",\"rdma_dmabuf_regions\":", gpu.rdma_dmabuf_regions,
      ",\"rdma_peermem_regions\":", gpu.rdma_peermem_regions, ",\"rdma_path_reason\":\"",
      JsonEscape(gpu.rdma_path_reason), "\",\"shm_ipc_opens\":", gpu.shm_ipc_opens,
      ",\"shm_device_copies\":", gpu.shm_device_copies,
      ",\"tcp_staged_bytes\":", gpu.tcp_staged_bytes, "}");
  absl::StrAppend(&out, ",\"tcp_listener\":{\"connections\":", tcp_listener.connections,
                  ",\"refused_over_limit\":", tcp_listener.refused_over_limit,
                  ",\"hello_refused\":", tcp_listener.hello_refused,
                  ",\"hello_timeouts\":", tcp_listener.hello_timeouts,
                  ",\"thread_failures\":", tcp_listener.thread_failures,
                  ",\"stalled_dropped\":", tcp_listener.stalled_dropped, "}}");
  return out;
}

std::string EngineStats::ToPrometheus(const std::string& engine_name) const {
  const std::string label = absl::StrCat("engine=\"", JsonEscape(engine_name), "\"");
  std::string out;
  auto metric = [&](const char* type, const char* name, const char* help, double value) {
    absl::StrAppend(&out, "# HELP kvwire_", name, " ", help, "\n# TYPE kvwire_", name, " ", type,
                    "\nkvwire_", name, "{", label, "} ", value, "\n");
  };
  auto counter = [&](const char* name, const char* help, double value) {
    metric("counter", name, help, value);
  };
  auto gauge = [&](const char* name, const char* help, double value) {
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
  counter("rdma_work_requests_total", "rdma work requests posted.", rdma.work_requests);
  counter("rdma_post_calls_total", "ibv_post_send calls (one per chain).", rdma.post_calls);
  counter("rdma_signalled_total", "rdma work requests posted signalled.", rdma.signalled);
  counter("rdma_inline_total", "rdma work requests with inline payload.", rdma.inline_wrs);
  counter("rdma_queued_total", "rdma work requests that waited for send-queue room.",
          rdma.queued_wrs);
  counter("rdma_completion_errors_total", "rdma work completions with an error status.",
          rdma.completion_errors);
  counter("rdma_async_events_total", "rdma error events (QP, CQ, port, device).",
          rdma.async_events);
  counter("rdma_qp_reconnects_total", "rdma QPs re-created after a failure.", rdma.qp_reconnects);
  gauge("gpu_regions", "GPU memory regions registered.", gpu.regions);
  counter("gpu_rdma_dmabuf_regions_total", "GPU regions registered with ibv_reg_dmabuf_mr.",
          gpu.rdma_dmabuf_regions);
  counter("gpu_rdma_peermem_regions_total",
          "GPU regions registered with ibv_reg_mr on the device pointer (peer memory).",
          gpu.rdma_peermem_regions);
  counter("gpu_shm_ipc_opens_total", "Peer GPU allocations opened from IPC handles.",
          gpu.shm_ipc_opens);
  counter("gpu_shm_device_copies_total", "Copies on the shm transport's device streams.",
          gpu.shm_device_copies);
  counter("gpu_tcp_staged_bytes_total", "Bytes staged through pinned host buffers (tcp).",
          gpu.tcp_staged_bytes);
  gauge("tcp_data_connections", "tcp data connections open, every stage.",
        tcp_listener.connections);
  counter("tcp_refused_over_limit_total", "tcp data connections refused by a connection limit.",
          tcp_listener.refused_over_limit);
  counter("tcp_hello_refused_total", "tcp data connections with a bad hello or unknown token.",
          tcp_listener.hello_refused);
  counter("tcp_hello_timeouts_total", "tcp data connections cut at the hello deadline.",
          tcp_listener.hello_timeouts);
  counter("tcp_thread_failures_total", "tcp data connections refused: no thread could start.",
          tcp_listener.thread_failures);
  counter("tcp_stalled_dropped_total", "tcp data connections cut mid-op by the I/O deadline.",
          tcp_listener.stalled_dropped);
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
  absl::StrAppend(&out, "# HELP kvwire_transfer_latency_us Transfer latency.\n",
                  "# TYPE kvwire_transfer_latency_us histogram\n");
  uint64_t cumulative = 0;
  for (int i = 0; i < LatencyHistogram::kBuckets - 1; ++i) {
    cumulative += transfer_latency.counts[i];
    absl::StrAppend(&out, "kvwire_transfer_latency_us_bucket{", label, ",le=\"", std::ldexp(1.0, i),
                    "\"} ", cumulative, "\n");
  }
  absl::StrAppend(&out, "kvwire_transfer_latency_us_bucket{", label, ",le=\"+Inf\"} ",
                  transfer_latency.samples, "\n", "kvwire_transfer_latency_us_sum{", label, "} ",
                  transfer_latency.sum_us, "\n", "kvwire_transfer_latency_us_count{", label, "} ",
                  transfer_latency.samples, "\n");
  absl::StrAppend(&out, "# TYPE kvwire_errors_total counter\n");
  for (const auto& [kind, count] : errors_by_kind) {
    absl::StrAppend(&out, "kvwire_errors_total{", label, ",kind=\"", kind, "\"} ", count, "\n");
  }
  absl::StrAppend(&out, "# TYPE kvwire_peer_info gauge\n");
  for (const PeerStats& p : peers) {
    absl::StrAppend(&out, "kvwire_peer_info{", label, ",peer=\"", JsonEscape(p.name),
                    "\",transport=\"", JsonEscape(p.transport), "\"} ", p.alive ? 1 : 0, "\n");
  }
  return out;
}

}  // namespace kvwire
