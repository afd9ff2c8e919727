#include "kvwire/options_check.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"

#include "src/util/option_range.h"

namespace kvwire {
namespace {

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = kKiB * 1024;
constexpr int64_t kGiB = kMiB * 1024;
constexpr int64_t kTiB = kGiB * 1024;

}  // namespace

absl::Status ValidateEngineOptions(const EngineOptions& o) {
  const absl::Duration ms = absl::Milliseconds(1);
  const absl::Duration hour = absl::Hours(1);
  const absl::Duration day = absl::Hours(24);
  // The transport forced by name must be one whose options the engine holds: every built-in,
  // and each outside transport that put its own (a name with a typo fails here, not at the
  // first Connect).
  if (o.transport != "auto" && o.transports.Find(o.transport) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("transport: unknown transport \"", o.transport,
                                                   "\" (expected auto, ",
                                                   absl::StrJoin(o.transports.Names(), ", "), ")"));
  }
  // Every range of every engine option, in the order of EngineOptions (include/kvwire/engine.h);
  // each transport's own, by its Validate().
  const absl::Status checks[] = {
      CheckOptionRange("max_op_bytes", o.max_op_bytes, 1, 64 * kMiB),
      CheckOptionRange("stripe_min_bytes", o.stripe_min_bytes, 0, kTiB),
      CheckOptionRange("max_frame_bytes", o.max_frame_bytes, 4 * kKiB, kGiB),
      CheckOptionRange("heartbeat_interval", o.heartbeat_interval, ms, hour),
      CheckOptionRange("peer_lease", o.peer_lease, ms, day),
      CheckOptionRange("connect_timeout", o.connect_timeout, ms, hour),
      CheckOptionRange("transfer_timeout", o.transfer_timeout, ms, day),
      CheckOptionRange("wait_poll", o.wait_poll, absl::ZeroDuration(), absl::Milliseconds(10)),
      CheckOptionRange("io_threads", o.io_threads, 1, 64),
      CheckOptionRange("max_message_bytes", o.max_message_bytes, 1, kGiB),
      CheckOptionRange("max_pending_handshakes", o.max_pending_handshakes, 1, 1 << 16),
      CheckOptionRange("max_pending_handshakes_per_source", o.max_pending_handshakes_per_source, 1,
                       1 << 16),
      CheckOptionRange("max_control_connections", o.max_control_connections, 1, 1 << 20),
      CheckOptionRange("max_control_send_queue_bytes", o.max_control_send_queue_bytes, 4 * kKiB,
                       kTiB),
      CheckOptionRange("max_undrained_notifications", o.max_undrained_notifications, 1,
                       int64_t{1} << 32),
      CheckOptionRange("closed_peers_kept", o.closed_peers_kept, 0, 1 << 16),
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
  return o.transports.Validate();
}

}  // namespace kvwire
