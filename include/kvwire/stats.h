// Engine counters: what moved, how fast, what failed, which transport each peer uses.
#ifndef KVWIRE_STATS_H_
#define KVWIRE_STATS_H_

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace kvwire {

// Latency histogram with power-of-two microsecond buckets: bucket i counts samples in
// [2^(i-1), 2^i) us (bucket 0: under 1 us); the last bucket is open-ended.
struct LatencyHistogram {
  static constexpr int kBuckets = 32;
  std::array<uint64_t, kBuckets> counts{};
  uint64_t samples = 0;
  double sum_us = 0;
  double max_us = 0;

  void Add(double us);
  // Upper bound of the bucket holding quantile q (0..1), in microseconds.
  double QuantileUpperBoundUs(double q) const;
};

struct PeerStats {
  uint64_t peer_id = 0;
  std::string name;
  std::string transport;         // chosen transport, e.g. "tcp", "shm", "shm+cma"
  std::string transport_reason;  // why it was chosen
  bool alive = false;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t transfers = 0;
};

// One statistic a transport reports, by name: every transport lists its own (see
// transport/transport.h, AddStats), at zero when it is not running, so the output keeps its
// shape. JSON lists it as "<group>":{"<name>":value}; Prometheus as kvwire_<metric> when
// `metric` is set (a counter's metric ends in _total).
struct TransportStat {
  enum class Kind { kCounter, kGauge, kText };
  std::string transport;  // the transport that reports it: "rdma", "shm", "tcp"
  std::string group;      // the JSON object that lists it, e.g. "rdma", "gpu", "tcp_listener"
  std::string name;       // its key in that object
  Kind kind = Kind::kCounter;
  uint64_t value = 0;  // kCounter (only grows), kGauge (a level now)
  std::string text;    // kText (JSON only), e.g. why the newest GPU region took its rdma path
  std::string metric;  // Prometheus name after "kvwire_"; "" = JSON only
  std::string help;    // Prometheus HELP
};

// GPU memory (all zero without kGpu regions). How the transports registered and moved it is in
// EngineStats::transport_stats, group "gpu" (e.g. rdma_dmabuf_regions, tcp_staged_bytes).
struct GpuStats {
  uint64_t regions = 0;  // kGpu regions registered now
};

// The control channel's trust boundary: handshakes, session tokens, bounded queues.
struct ControlStats {
  uint64_t handshakes_in_flight = 0;       // inbound, not yet authenticated
  uint64_t control_connections = 0;        // inbound control sockets open
  uint64_t handshakes_failed = 0;          // inbound: bad Hello or proof, deadline, I/O error
  uint64_t handshakes_refused = 0;         // inbound: over max_pending_handshakes/connections
  uint64_t session_tokens = 0;             // live tokens (one per authenticated peer)
  uint64_t notifications_dropped = 0;      // over max_undrained_notifications
  uint64_t peers_closed_for_protocol = 0;  // unknown/malformed control message, queue overrun
};

struct EngineStats {
  uint64_t regions = 0;
  uint64_t registered_bytes = 0;
  double registration_us_total = 0;
  uint64_t bytes_read = 0;     // initiated READs, completed successfully
  uint64_t bytes_written = 0;  // initiated WRITEs, completed successfully
  uint64_t ops_submitted = 0;  // as given to Transfer
  uint64_t ops_posted = 0;     // after merging and splitting
  uint64_t transfers_started = 0;
  uint64_t transfers_succeeded = 0;
  uint64_t transfers_failed = 0;
  uint64_t notifications_sent = 0;
  uint64_t notifications_delivered = 0;
  // Ops served as a target and refused by its validation: ops of a transport whose target
  // validates each op through the engine (TargetHooks::ResolveIncoming: tcp among the built-in
  // ones). shm and rdma ops are one-sided: they never reach the target engine.
  uint64_t incoming_ops = 0;
  uint64_t incoming_rejected = 0;
  // READs of grant-guarded regions (RegionOptions::reads_need_grant) refused for want of a
  // live grant covering them (no grant, unknown or revoked grant, range outside it); also in
  // incoming_rejected. And the grants live now (Engine::Grant, not yet revoked).
  uint64_t grant_refused = 0;
  uint64_t grants_live = 0;
  LatencyHistogram transfer_latency;
  std::map<std::string, uint64_t> errors_by_kind;  // absl::StatusCode name -> count
  std::vector<PeerStats> peers;
  GpuStats gpu;
  ControlStats control;
  // Every transport's statistics, in the order the transports list them.
  std::vector<TransportStat> transport_stats;

  // The statistic `name` of `group` in transport_stats, or null.
  const TransportStat* FindTransportStat(std::string_view group, std::string_view name) const;
  // Its value; 0 when it is not listed.
  uint64_t TransportStatValue(std::string_view group, std::string_view name) const;

  std::string ToJson() const;
  std::string ToPrometheus(const std::string& engine_name) const;
};

}  // namespace kvwire

#endif  // KVWIRE_STATS_H_
