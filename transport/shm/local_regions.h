// The regions registered with the shm transport. Each memfd-backed region keeps a private
// duplicate of its memfd, so that the descriptor handed to peers is always the memfd that was
// registered, even if the caller closes (and the process reuses) the original number.
#ifndef KVWIRE_TRANSPORT_SHM_LOCAL_REGIONS_H_
#define KVWIRE_TRANSPORT_SHM_LOCAL_REGIONS_H_

#include <cstdint>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

#include "src/util/mutex.h"
#include "transport/shm/unique_fd.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

struct LocalRegionEntry {
  RegionId id = 0;
  uint64_t length = 0;
  uint32_t access = kAccessNone;
  UniqueFd memfd;  // invalid when the region is not memfd-backed
  uint64_t memfd_offset = 0;
};

class LocalRegionTable {
 public:
  // Checks a memfd-backed region (the memfd covers it, and is sealed against shrinking, so
  // that a peer's mapping can never fault) and keeps a duplicate of its descriptor.
  absl::Status Add(const LocalRegion& region);
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
