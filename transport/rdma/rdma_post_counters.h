// The rdma transport's counters, shared by its QPs, its event threads and AddStats.
#ifndef KVWIRE_TRANSPORT_RDMA_RDMA_POST_COUNTERS_H_
#define KVWIRE_TRANSPORT_RDMA_RDMA_POST_COUNTERS_H_

#include <atomic>
#include <cstdint>

namespace kvwire::transport::rdma {

// Counters of the posting path (EngineStats::rdma and the per-1000-ops figures).
struct PostCounters {
  std::atomic<uint64_t> post_calls{0};
  std::atomic<uint64_t> wrs{0};
  std::atomic<uint64_t> signalled{0};
  std::atomic<uint64_t> pieces{0};
  std::atomic<uint64_t> inline_wrs{0};
  std::atomic<uint64_t> queued_wrs{0};
  std::atomic<uint64_t> completion_errors{0};
  std::atomic<uint64_t> async_events{0};
  std::atomic<uint64_t> qp_reconnects{0};
};

}  // namespace kvwire::transport::rdma

#endif  // KVWIRE_TRANSPORT_RDMA_RDMA_POST_COUNTERS_H_
