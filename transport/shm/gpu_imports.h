// The importing side of GPU regions on the shm transport (one per channel): a peer's device
// allocation is opened from its IPC handle once, however many of its regions this channel
// uses, and closed when the last user lets go (its regions removed, the channel closed, and
// no copy in flight).
#ifndef KVWIRE_TRANSPORT_SHM_GPU_IMPORTS_H_
#define KVWIRE_TRANSPORT_SHM_GPU_IMPORTS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

#include "src/gpu/runtime.h"
#include "src/util/mutex.h"
#include "transport/shm/gpu_region_key.h"

namespace kvwire::transport::shm {

// Counters of the shm transport's GPU path, shared by the transport and its channels.
struct ShmGpuCounters {
  std::atomic<uint64_t> ipc_opens{0};
  std::atomic<uint64_t> device_copies{0};
};

// A peer allocation mapped into this process; unmapped (CloseIpc) on destruction.
class GpuPeerAllocation {
 public:
  GpuPeerAllocation(gpu::Runtime* runtime, int device, std::byte* base, uint64_t size,
                    bool ipc_opened)
      : runtime_(runtime), device_(device), base_(base), size_(size), ipc_opened_(ipc_opened) {}
  ~GpuPeerAllocation();
  GpuPeerAllocation(const GpuPeerAllocation&) = delete;
  GpuPeerAllocation& operator=(const GpuPeerAllocation&) = delete;

  // The local device the mapping belongs to (where its copies run).
  int device() const { return device_; }
  std::byte* base() const { return base_; }
  uint64_t size() const { return size_; }

 private:
  gpu::Runtime* const runtime_;
  const int device_;
  std::byte* const base_;
  const uint64_t size_;
  // False for an allocation of this very process (used in place: a runtime cannot open its
  // own process's handle).
  const bool ipc_opened_;
};

class GpuImports {
 public:
  GpuImports(gpu::Runtime* runtime, std::shared_ptr<ShmGpuCounters> counters)
      : runtime_(runtime), counters_(std::move(counters)) {}

  // The mapping of `key`'s allocation: the one already open for an earlier region of it, or
  // newly opened. `address` is the region's address in the exporting process (used in place
  // when that process is this one).
  absl::StatusOr<std::shared_ptr<const GpuPeerAllocation>> Open(const GpuRegionKey& key,
                                                                uint64_t address)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The local device to open a peer's allocation on: the one with the exporter's PCI bus id
  // (device ordinals differ between processes with different CUDA_VISIBLE_DEVICES), else the
  // exporter's ordinal.
  absl::StatusOr<int> LocalDevice(const GpuRegionKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  gpu::Runtime* const runtime_;
  const std::shared_ptr<ShmGpuCounters> counters_;
  Mutex mu_;
  // By backend + handle bytes; expired entries are dropped on the next Open.
  absl::flat_hash_map<std::string, std::weak_ptr<const GpuPeerAllocation>> open_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, int> device_by_pci_ ABSL_GUARDED_BY(mu_);
  bool devices_listed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_GPU_IMPORTS_H_
