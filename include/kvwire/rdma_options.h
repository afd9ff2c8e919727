// The rdma transport's options (EngineOptions::transports["rdma"], or EngineOptions::rdma()),
// checked by their own Validate() (transport/rdma/rdma_options.cc). Used when a usable RDMA
// device exists; transport "auto" picks rdma for peers on other hosts that offer it too.
#ifndef KVWIRE_RDMA_OPTIONS_H_
#define KVWIRE_RDMA_OPTIONS_H_

#include <string>
#include <vector>

#include "kvwire/transport_options.h"

namespace kvwire {

struct RdmaOptions : TransportOptionsOf<RdmaOptions> {
  static constexpr char kName[] = "rdma";

  // Device allow-list, "mlx5_0" or "mlx5_0:1" entries (like perftest -d). Empty: every
  // device with an ACTIVE port.
  std::vector<std::string> devices;
  // RoCE GID index; -1 picks the first IPv4-mapped RoCE v2 GID. -1..1023.
  int gid_index = -1;
  // RC queue pairs per peer and device; a transfer is striped over them. 1..64.
  int qps_per_peer = 4;
  // Send-queue depth (work requests) of each QP; more is queued, never posted. 16..16384.
  int send_queue_depth = 256;
  // RC local ACK timeout exponent (4.096 us * 2^n; 14 = 67 ms; 0..31), retry count (0..7)
  // and RNR retry count (7 = retry forever; 0..7). The retry count is 6, not 7: soft-RoCE
  // (rxe) reads a retry count of 7 as "retry forever" like the RNR count, so a QP whose peer
  // QP broke would never fail and never be rebuilt (every transfer on it would only end by
  // its deadline); elsewhere 7 and 6 differ by one retry.
  int qp_timeout = 14;
  int retry_count = 6;
  int rnr_retry = 7;
  // Most QPs this engine holds on one device, all peers together (0: the device's max_qp);
  // a peer that would pass it is refused with an error naming the budget. 0..2^24.
  int max_qps_per_device = 0;

  absl::Status Validate() const override;
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::Status Get(absl::string_view key, std::string* value) const override;
  std::vector<std::string> Keys() const override;
};

}  // namespace kvwire

#endif  // KVWIRE_RDMA_OPTIONS_H_
