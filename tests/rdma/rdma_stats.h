// The rdma transport's statistics as the VM tests read them, from the generic list
// EngineStats::transport_stats (names: transport/rdma/rdma_transport.cc, RdmaTransportStats).
#ifndef KVWIRE_TESTS_RDMA_RDMA_STATS_H_
#define KVWIRE_TESTS_RDMA_RDMA_STATS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kvwire/stats.h"

namespace kvwire::testing {

struct RdmaStats {
  uint64_t work_requests = 0;
  uint64_t post_calls = 0;
  uint64_t signalled = 0;
  uint64_t inline_wrs = 0;
  uint64_t queued_wrs = 0;
  uint64_t completion_errors = 0;
  uint64_t async_events = 0;
  uint64_t qp_reconnects = 0;
  // Group "gpu".
  uint64_t rdma_dmabuf_regions = 0;
  uint64_t rdma_peermem_regions = 0;
  std::string rdma_path_reason;
};

inline RdmaStats RdmaOf(const EngineStats& s) {
  RdmaStats r;
  r.work_requests = s.TransportStatValue("rdma", "work_requests");
  r.post_calls = s.TransportStatValue("rdma", "post_calls");
  r.signalled = s.TransportStatValue("rdma", "signalled");
  r.inline_wrs = s.TransportStatValue("rdma", "inline_wrs");
  r.queued_wrs = s.TransportStatValue("rdma", "queued_wrs");
  r.completion_errors = s.TransportStatValue("rdma", "completion_errors");
  r.async_events = s.TransportStatValue("rdma", "async_events");
  r.qp_reconnects = s.TransportStatValue("rdma", "qp_reconnects");
  r.rdma_dmabuf_regions = s.TransportStatValue("gpu", "rdma_dmabuf_regions");
  r.rdma_peermem_regions = s.TransportStatValue("gpu", "rdma_peermem_regions");
  if (const TransportStat* reason = s.FindTransportStat("gpu", "rdma_path_reason")) {
    r.rdma_path_reason = reason->text;
  }
  return r;
}

// What one transport's AddStats reported, over the declarations of the rdma transport.
inline EngineStats StatsOf(std::vector<TransportStat> declared) {
  EngineStats s;
  s.transport_stats = std::move(declared);
  return s;
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_RDMA_RDMA_STATS_H_
