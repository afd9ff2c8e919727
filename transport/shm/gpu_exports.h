// The exporting side of GPU regions on the shm transport: each device allocation that holds a
// registered kGpu region has its IPC handle exported once (however many regions lie in it),
// and each region gets its key (gpu_region_key.h) for peers.
#ifndef KVWIRE_TRANSPORT_SHM_GPU_EXPORTS_H_
#define KVWIRE_TRANSPORT_SHM_GPU_EXPORTS_H_

#include <cstddef>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

#include "src/gpu/runtime.h"
#include "src/util/mutex.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

class GpuExportTable {
 public:
  // `runtime` null: every Add fails (this engine moves no GPU memory over shm).
  explicit GpuExportTable(gpu::Runtime* runtime) : runtime_(runtime) {}

  // A kGpu region: exports its allocation's IPC handle unless a region of that allocation is
  // registered already, and builds the region's key.
  absl::Status Add(const LocalRegion& region) ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(RegionId id) ABSL_LOCKS_EXCLUDED(mu_);
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);
  // Empty when `id` is not a registered GPU region.
  std::string Key(RegionId id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Allocations exported now (for tests and logs).
  size_t allocations() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Allocation {
    gpu::IpcHandle handle;
    uint64_t size = 0;
    uint32_t pci_bus_id = 0;
    size_t regions = 0;
  };
  struct Region {
    std::string key;
    std::pair<int, std::byte*> allocation;
  };

  gpu::Runtime* const runtime_;
  mutable Mutex mu_;
  // By (device, allocation base). Erased with its last region, so that memory freed and
  // allocated again at the same address is exported again.
  absl::flat_hash_map<std::pair<int, std::byte*>, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<RegionId, Region> regions_ ABSL_GUARDED_BY(mu_);
  // PCI bus id of each device, packed (asked once per device).
  absl::flat_hash_map<int, uint32_t> pci_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_GPU_EXPORTS_H_
