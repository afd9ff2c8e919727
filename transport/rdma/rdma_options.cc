// RdmaOptions (include/kvwire/rdma_options.h): its ranges and its by-name setter. The ranges
// are what the verbs accept (a QP attribute's bits) or what the transport was tested with;
// nothing below clamps (transport/builtin_transports.cc passes them on as they are).
#include "kvwire/rdma_options.h"

#include "src/util/option_range.h"
#include "src/util/options_by_name.h"

namespace kvwire {
namespace {

// Every option by its key (TransportOptions::Set), in the order of the struct.
template <typename Self, typename F>
void Fields(Self& o, F&& f) {
  f("devices", o.devices);
  f("gid_index", o.gid_index);
  f("qps_per_peer", o.qps_per_peer);
  f("send_queue_depth", o.send_queue_depth);
  f("qp_timeout", o.qp_timeout);
  f("retry_count", o.retry_count);
  f("rnr_retry", o.rnr_retry);
  f("max_qps_per_device", o.max_qps_per_device);
}

}  // namespace

absl::Status RdmaOptions::Validate() const {
  const absl::Status checks[] = {
      CheckOptionRange("rdma.gid_index", gid_index, -1, 1023),
      CheckOptionRange("rdma.qps_per_peer", qps_per_peer, 1, 64),
      CheckOptionRange("rdma.send_queue_depth", send_queue_depth, 16, 16384),
      CheckOptionRange("rdma.qp_timeout", qp_timeout, 0, 31),
      CheckOptionRange("rdma.retry_count", retry_count, 0, 7),
      CheckOptionRange("rdma.rnr_retry", rnr_retry, 0, 7),
      CheckOptionRange("rdma.max_qps_per_device", max_qps_per_device, 0, 1 << 24),
  };
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

KVWIRE_OPTIONS_BY_NAME(RdmaOptions)

}  // namespace kvwire
