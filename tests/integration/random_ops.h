// Random op lists for the multi-process engine tests (tcp/shm here, rdma in the VM).
#ifndef KVWIRE_TESTS_INTEGRATION_RANDOM_OPS_H_
#define KVWIRE_TESTS_INTEGRATION_RANDOM_OPS_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kvwire/engine.h"

namespace kvwire::testing {

// 1..48 ops of 1 B..1 MiB: local ranges packed from 0 (with small gaps) below `local_limit`,
// remote ranges in the first `regions` of `remote` (each `region_bytes` long), ascending
// and non-overlapping per region. Stops early rather than run past a limit.
inline std::vector<Op> RandomOps(std::mt19937_64& rng, RegionId local_region, uint64_t local_limit,
                                 const std::vector<RegionId>& remote, int regions,
                                 uint64_t region_bytes) {
  std::vector<Op> ops;
  const int n = 1 + rng() % 48;
  uint64_t local = 0;
  std::vector<uint64_t> cursor(regions, 0);
  for (int i = 0; i < n; ++i) {
    const int r = rng() % regions;
    const uint64_t len = 1 + rng() % (rng() % 4 == 0 ? (1 << 20) : 9000);
    const uint64_t gap = rng() % 3 == 0 ? 0 : rng() % 5000;
    if (cursor[r] + gap + len > region_bytes || local + len > local_limit) break;
    ops.push_back(Op{local_region, local, remote[r], cursor[r] + gap, len});
    cursor[r] += gap + len;
    local += len + (rng() % 2 ? 0 : 64);
  }
  return ops;
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_INTEGRATION_RANDOM_OPS_H_
