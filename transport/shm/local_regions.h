// The regions registered with the shm transport. Each memfd-backed region keeps a private
// duplicate of its memfd, so that the descriptor handed to peers is always the memfd that was
// registered, even if the caller closes (and the process reuses) the original number.
#ifndef KVWIRE_TRANSPORT_SHM_LOCAL_REGIONS_H_
#define KVWIRE_TRANSPORT_SHM_LOCAL_REGIONS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

#include "src/util/mutex.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/unique_fd.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

struct LocalRegionEntry {
  RegionId id = 0;
  uint64_t length = 0;
  uint32_t access = kAccessNone;
  UniqueFd memfd;  // invalid when the region is not memfd-backed or its memfd is not shared
  uint64_t memfd_offset = 0;
  // The region lies in a ShareableBuffer (its key tells peers so, host_region_key.h), whether
  // or not its memfd is shared.
  bool memfd_backed = false;
  // Why a memfd-backed region's descriptor is never handed to peers (empty when it is, or
  // when the region has no memfd): the peer is told, and its engine moves the region over a
  // path where this side validates every access (tcp).
  std::string not_shared;
};

class LocalRegionTable {
 public:
  // Registers a region; `backing`: the memfd it lies in (FindShareable), if any. Checks a
  // memfd-backed region (the memfd covers it, and is sealed against shrinking, so
  // that a peer's mapping can never fault) and keeps a duplicate of its descriptor.
  //
  // A peer that receives the descriptor holds the whole file, whatever part of it the region
  // is and whatever mode the descriptor was passed with (it can reopen it read-write through
  // /proc/self/fd). So the descriptor is shared only when the region is the whole memfd, and
  // only after the memfd's seals enforce the region's rights on every holder: F_SEAL_SEAL
  // always, plus F_SEAL_FUTURE_WRITE (no new writable mapping, no write(2), no hole
  // punching; this process's own mapping stays writable) when peers may only read it.
  // Otherwise the region is registered without a shared memfd (`not_shared` says why).
  absl::Status Add(const LocalRegion& region, std::optional<ShareableBacking> backing);
  void Remove(RegionId id);
  void Clear();
  // Null when not registered. The entry stays valid (and its fd open) while held.
  std::shared_ptr<const LocalRegionEntry> Find(RegionId id) const;

 private:
  mutable Mutex mu_;
  absl::flat_hash_map<RegionId, std::shared_ptr<const LocalRegionEntry>> regions_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_LOCAL_REGIONS_H_
