#include "src/core/options_check.h"

#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "src/util/option_range.h"

namespace kvwire {
namespace {

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = kKiB * 1024;
constexpr int64_t kGiB = kMiB * 1024;
constexpr int64_t kTiB = kGiB * 1024;

// An integer option within [lo, hi]; unsigned fields compare without wrapping.
template <typename T>
absl::Status Check(absl::string_view option, T value, int64_t lo, int64_t hi) {
  bool inside;
  if constexpr (std::is_unsigned_v<T>) {
    inside = value <= static_cast<uint64_t>(hi) && (lo <= 0 || value >= static_cast<uint64_t>(lo));
  } else {
    inside = value >= lo && value <= hi;
  }
  return inside ? absl::OkStatus() : OptionOutOfRange(option, value, lo, hi);
}

absl::Status Check(absl::string_view option, absl::Duration value, absl::Duration lo,
                   absl::Duration hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return OptionOutOfRange(option, absl::FormatDuration(value), absl::FormatDuration(lo),
                          absl::FormatDuration(hi));
}

}  // namespace

absl::Status ValidateEngineOptions(const EngineOptions& o) {
  const absl::Duration ms = absl::Milliseconds(1);
  const absl::Duration hour = absl::Hours(1);
  const absl::Duration day = absl::Hours(24);
  // Every range of every option, in the order of EngineOptions (include/kvwire/engine.h).
  const absl::Status checks[] = {
      Check("tcp_connections", o.tcp_connections, 1, 64),
      Check("tcp_io_threads", o.tcp_io_threads, 0, 64),
      Check("tcp_io_poll", o.tcp_io_poll, absl::ZeroDuration(), absl::Milliseconds(10)),
      Check("max_op_bytes", o.max_op_bytes, 1, 64 * kMiB),
      Check("stripe_min_bytes", o.stripe_min_bytes, 0, kTiB),
      Check("max_frame_bytes", o.max_frame_bytes, 4 * kKiB, kGiB),
      Check("heartbeat_interval", o.heartbeat_interval, ms, hour),
      Check("peer_lease", o.peer_lease, ms, day),
      Check("connect_timeout", o.connect_timeout, ms, hour),
      Check("transfer_timeout", o.transfer_timeout, ms, day),
      Check("io_threads", o.io_threads, 1, 64),
      Check("max_message_bytes", o.max_message_bytes, 1, kGiB),
      Check("rdma_gid_index", o.rdma_gid_index, -1, 1023),
      Check("rdma_qps_per_peer", o.rdma_qps_per_peer, 1, 64),
      Check("rdma_send_queue_depth", o.rdma_send_queue_depth, 16, 16384),
      Check("rdma_qp_timeout", o.rdma_qp_timeout, 0, 31),
      Check("rdma_retry_count", o.rdma_retry_count, 0, 7),
      Check("rdma_rnr_retry", o.rdma_rnr_retry, 0, 7),
      Check("rdma_max_qps_per_device", o.rdma_max_qps_per_device, 0, 1 << 24),
      Check("tcp_max_data_connections", o.tcp_max_data_connections, 1, 1 << 20),
      Check("tcp_max_data_connections_per_peer", o.tcp_max_data_connections_per_peer, 1, 1 << 16),
      Check("tcp_max_pending_hellos", o.tcp_max_pending_hellos, 1, 1 << 16),
      Check("tcp_max_pending_hellos_per_address", o.tcp_max_pending_hellos_per_address, 1, 1 << 16),
      Check("tcp_hello_timeout", o.tcp_hello_timeout, ms, hour),
      Check("tcp_io_timeout", o.tcp_io_timeout, ms, hour),
      Check("max_pending_handshakes", o.max_pending_handshakes, 1, 1 << 16),
      Check("max_pending_handshakes_per_source", o.max_pending_handshakes_per_source, 1, 1 << 16),
      Check("max_control_connections", o.max_control_connections, 1, 1 << 20),
      Check("max_control_send_queue_bytes", o.max_control_send_queue_bytes, 4 * kKiB, kTiB),
      Check("max_undrained_notifications", o.max_undrained_notifications, 1, int64_t{1} << 32),
      Check("closed_peers_kept", o.closed_peers_kept, 0, 1 << 16),
  };
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  // Options each in range but unworkable together.
  if (o.max_message_bytes >= o.max_frame_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes: ", o.max_message_bytes,
                                                   " must stay below max_frame_bytes (",
                                                   o.max_frame_bytes, ")"));
  }
  if (o.max_control_send_queue_bytes < uint64_t{o.max_frame_bytes} + 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_control_send_queue_bytes: ", o.max_control_send_queue_bytes,
        " must be at least max_frame_bytes + 4 (", uint64_t{o.max_frame_bytes} + 4, ")"));
  }
  if (o.shm_cma && o.shm_deny_ptrace) {
    return absl::InvalidArgumentError("shm_cma and shm_deny_ptrace cannot be combined");
  }
  return absl::OkStatus();
}

}  // namespace kvwire
