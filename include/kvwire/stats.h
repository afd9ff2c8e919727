// Engine counters: what moved, how fast, what failed, which transport each peer uses.
#ifndef KVWIRE_STATS_H_
#define KVWIRE_STATS_H_

#include <array>
#include <cstdint>
#include <map>
#include <string>
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

// The rdma transport's posting path (all zero without rdma). Chains: one ibv_post_send each.
struct RdmaStats {
  uint64_t work_requests = 0;      // WRs posted (a WR gathers up to max_sge merged pieces)
  uint64_t post_calls = 0;         // ibv_post_send calls
  uint64_t signalled = 0;          // WRs posted with IBV_SEND_SIGNALED
  uint64_t inline_wrs = 0;         // WRs whose payload went inline
  uint64_t queued_wrs = 0;         // WRs that waited for send-queue room (admission control)
  uint64_t completion_errors = 0;  // work completions with an error status (flushes excluded)
  uint64_t async_events = 0;       // error events: QP fatal, CQ error, port error, device fatal
  uint64_t qp_reconnects = 0;      // QPs re-created after a failure
};

// GPU memory (all zero without kGpu regions): how it was registered and moved.
struct GpuStats {
  uint64_t regions = 0;               // kGpu regions registered now
  uint64_t rdma_dmabuf_regions = 0;   // registered with ibv_reg_dmabuf_mr on a runtime dma-buf
  uint64_t rdma_peermem_regions = 0;  // registered with ibv_reg_mr on the device pointer
  // Why the newest GPU region took the rdma path it took (e.g. why not dma-buf); "" if none.
  std::string rdma_path_reason;
  uint64_t shm_ipc_opens = 0;      // peer allocations opened from IPC handles
  uint64_t shm_device_copies = 0;  // copies on the shm transport's device streams
  uint64_t tcp_staged_bytes = 0;   // bytes staged through pinned host buffers (tcp)
};

// The tcp data listener's limits at work (see TcpTransportOptions): what it refused and why.
struct TcpListenerStats {
  uint64_t connections = 0;         // data connections open now, every stage (gauge)
  uint64_t refused_over_limit = 0;  // refused by a connection limit (total, address, peer)
  uint64_t hello_refused = 0;       // bad hello or token not accepted
  uint64_t hello_timeouts = 0;      // hello stage not complete by its absolute deadline
  uint64_t thread_failures = 0;     // no serving thread could be started: refused
  uint64_t stalled_dropped = 0;     // cut mid-op by io_timeout; the peer was dropped
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
  uint64_t incoming_ops = 0;  // ops served as a target (tcp)
  uint64_t incoming_rejected = 0;
  LatencyHistogram transfer_latency;
  std::map<std::string, uint64_t> errors_by_kind;  // absl::StatusCode name -> count
  std::vector<PeerStats> peers;
  RdmaStats rdma;
  GpuStats gpu;
  TcpListenerStats tcp_listener;
  ControlStats control;

  std::string ToJson() const;
  std::string ToPrometheus(const std::string& engine_name) const;
};

}  // namespace kvwire

#endif  // KVWIRE_STATS_H_
