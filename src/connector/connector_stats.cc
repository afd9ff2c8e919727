// Connector accounting: per-request timings and per-group bytes/ops, and the JSON and
// Prometheus snapshots.
#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"
#include "src/util/prometheus_text.h"

namespace kvwire {

std::string Connector::Impl::StatsJson() const {
  MutexLock lock(&mu_);  // with accounting_'s: live requests and outcomes balance
  const connector_internal::ConnectorMetrics::Snapshot m = accounting_.Get();
  json groups = json::object();
  for (const auto& [name, c] : m.group_totals) {
    groups[name] = {{"bytes", c.bytes}, {"ops_before_merge", c.ops_before_merge}, {"ops", c.ops}};
  }
  size_t releasing = 0;  // prefill read: freed once the engine served what the readers read
  for (const auto& [id, r] : table_.requests) releasing += r.state == State::kReleasing ? 1 : 0;
  json j = {
      {"engine_id", engine_->name()},
      {"live_requests", table_.requests.size()},
      {"releasing", releasing},
      {"started", m.started},
      {"completed", m.completed},
      {"failed", m.failed},
      {"withdrawn", m.withdrawn},
      {"released", m.released},
      {"lease_expired", m.lease_expired},
      {"reads_refused", m.reads_refused},
      {"served_past_deadline",
       {{"readers_closed", served_late_.readers_closed},
        {"freed_while_served", served_late_.freed_while_served}}},
      {"machine",
       {{"steps", machine_.steps}, {"refused", machine_.refused}, {"diverged", machine_.diverged}}},
      {"groups", groups},
      {"requests", m.recent}};
  return DumpJson(j);
}

std::string Connector::Impl::StatsPrometheus() const {
  MutexLock lock(&mu_);
  const connector_internal::ConnectorMetrics::Snapshot m = accounting_.Get();
  const std::string e = PrometheusLabelValue(engine_->name());
  std::string out;
  const auto family = [&](const char* name, const char* type, const char* help) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  };
  family("kvwire_connector_requests_total", "counter", "Requests retired, by outcome.");
  absl::StrAppend(&out, "kvwire_connector_requests_total{engine=\"", e,
                  "\",outcome=\"completed\"} ", m.completed, "\n");
  absl::StrAppend(&out, "kvwire_connector_requests_total{engine=\"", e, "\",outcome=\"failed\"} ",
                  m.failed, "\n");
  absl::StrAppend(&out, "kvwire_connector_requests_total{engine=\"", e,
                  "\",outcome=\"withdrawn\"} ", m.withdrawn, "\n");
  absl::StrAppend(&out, "kvwire_connector_requests_total{engine=\"", e, "\",outcome=\"released\"} ",
                  m.released, "\n");
  family("kvwire_connector_requests_started_total", "counter", "Requests started.");
  absl::StrAppend(&out, "kvwire_connector_requests_started_total{engine=\"", e, "\"} ", m.started,
                  "\n");
  family("kvwire_connector_lease_expired_total", "counter",
         "Requests whose lease expired before the peer finished.");
  absl::StrAppend(&out, "kvwire_connector_lease_expired_total{engine=\"", e, "\"} ",
                  m.lease_expired, "\n");
  family("kvwire_connector_reads_refused_total", "counter",
         "read_start for a transfer id not held here (unknown or released): no grant given.");
  absl::StrAppend(&out, "kvwire_connector_reads_refused_total{engine=\"", e, "\"} ",
                  m.reads_refused, "\n");
  family("kvwire_connector_served_past_deadline_total", "counter",
         "Prefill read: ops under revoked grants still served at a releasing request's "
         "deadlines, by what was done: readers_closed (the second deadline closed the reader), "
         "freed_while_served (the third freed the blocks anyway).");
  absl::StrAppend(&out, "kvwire_connector_served_past_deadline_total{engine=\"", e,
                  "\",action=\"readers_closed\"} ", served_late_.readers_closed, "\n");
  absl::StrAppend(&out, "kvwire_connector_served_past_deadline_total{engine=\"", e,
                  "\",action=\"freed_while_served\"} ", served_late_.freed_while_served, "\n");
  family("kvwire_connector_machine_events_total", "counter",
         "Request events fed to the transition table, by result: taken, refused (no row takes "
         "the event in the request's state), diverged (a request ended other than its table "
         "row).");
  absl::StrAppend(&out, "kvwire_connector_machine_events_total{engine=\"", e,
                  "\",result=\"taken\"} ", machine_.steps - machine_.refused, "\n");
  absl::StrAppend(&out, "kvwire_connector_machine_events_total{engine=\"", e,
                  "\",result=\"refused\"} ", machine_.refused, "\n");
  absl::StrAppend(&out, "kvwire_connector_machine_events_total{engine=\"", e,
                  "\",result=\"diverged\"} ", machine_.diverged, "\n");
  family("kvwire_connector_live_requests", "gauge", "Requests not retired yet.");
  absl::StrAppend(&out, "kvwire_connector_live_requests{engine=\"", e, "\"} ",
                  table_.requests.size(), "\n");
  family("kvwire_connector_group_bytes_total", "counter",
         "Bytes moved by completed requests, by layout group.");
  for (const auto& [g, c] : m.group_totals) {
    absl::StrAppend(&out, "kvwire_connector_group_bytes_total{engine=\"", e, "\",group=\"",
                    PrometheusLabelValue(g), "\"} ", c.bytes, "\n");
  }
  family("kvwire_connector_group_ops_total", "counter",
         "Ops of completed requests, by layout group, before and after merging.");
  for (const auto& [g, c] : m.group_totals) {
    const std::string group = PrometheusLabelValue(g);
    absl::StrAppend(&out, "kvwire_connector_group_ops_total{engine=\"", e, "\",group=\"", group,
                    "\",merged=\"false\"} ", c.ops_before_merge, "\n");
    absl::StrAppend(&out, "kvwire_connector_group_ops_total{engine=\"", e, "\",group=\"", group,
                    "\",merged=\"true\"} ", c.ops, "\n");
  }
  // Seconds from a request's first to its last byte, summed over the retired requests (a
  // counter in base units, like process_cpu_seconds_total).
  family("kvwire_connector_transfer_seconds_total", "counter",
         "Time from a request's first to its last byte, summed over retired requests.");
  absl::StrAppend(&out, "kvwire_connector_transfer_seconds_total{engine=\"", e, "\"} ",
                  PrometheusNumber(m.transfer_seconds), "\n");
  return out;
}

void Connector::Impl::Account(Request& r, const TransferPlan& plan) {
  for (const GroupPlan& g : plan.groups) {
    GroupCounters& c = r.groups[g.group];
    c.bytes += g.bytes;
    c.ops_before_merge += g.ops_before_merge;
    c.ops += g.ranges.size();
  }
}

void Connector::Impl::Retire(Request& r, const char* outcome) {
  json groups = json::object();
  for (const auto& [g, c] : r.groups) {
    groups[g] = {{"bytes", c.bytes}, {"ops_before_merge", c.ops_before_merge}, {"ops", c.ops}};
  }
  double transfer_seconds = 0;
  if (r.t_first != absl::InfinitePast() && r.t_last != absl::InfinitePast()) {
    transfer_seconds = absl::ToDoubleSeconds(r.t_last - r.t_first);
  }
  using Outcome = connector_internal::ConnectorMetrics::Outcome;
  const std::string o(outcome);
  CheckMachineEndLocked(r, o == "completed"  ? State::kCompleted
                           : o == "released" ? State::kReleased
                                             : State::kFailed);
  accounting_.Retired(o == "completed"  ? Outcome::kCompleted
                      : o == "released" ? Outcome::kReleased
                                        : Outcome::kFailed,
                      r.groups, transfer_seconds,
                      {{"request_id", r.id},
                       {"transfer_id", r.params.transfer_id},
                       {"role", r.decode ? "decode" : "prefill"},
                       {"mode", KvModeName(r.mode)},
                       {"outcome", outcome},
                       {"reason", r.fail_reason},
                       {"queue_us", connector_internal::Us(r.t_queued, r.t_first)},
                       {"first_byte_us", connector_internal::Us(r.t_queued, r.t_first)},
                       {"last_byte_us", connector_internal::Us(r.t_queued, r.t_last)},
                       {"connector_cpu_us", r.cpu_us},
                       {"groups", groups}});
  table_.by_transfer.erase(r.params.transfer_id);
  RevokeGrantLocked(r);
  cv_.SignalAll();
  const std::string id = r.id;
  table_.requests.erase(id);  // `r` dies here
}

}  // namespace kvwire
