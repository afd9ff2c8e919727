// The regions registered with the shm transport, and which peers were handed each region's
// memfd (so that revoking one of them moves the buffer: shareable_registry.h). The memfd is
// looked up by address when it is served (the buffer's current one: revocation replaces it),
// and only while the ShareableBuffer that was registered lives.
#ifndef KVWIRE_TRANSPORT_SHM_LOCAL_REGIONS_H_
#define KVWIRE_TRANSPORT_SHM_LOCAL_REGIONS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "src/util/mutex.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/unique_fd.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

struct LocalRegionEntry {
  RegionId id = 0;
  uint64_t length = 0;
  uint32_t access = kAccessNone;
  const std::byte* base = nullptr;
  // The region is a whole memfd that peers may map (sealed for its rights).
  bool shared = false;
  // The ShareableBuffer registered (ShareableBacking::buffer): a buffer that replaced it at
  // the same address is not served.
  uint64_t buffer = 0;
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
  // Removes the region; returns its base when a peer was handed its memfd (the caller
  // revokes it: RebackShareable), else null.
  const std::byte* Remove(RegionId id);
  void Clear();
  // Null when not registered. The entry stays valid while held.
  std::shared_ptr<const LocalRegionEntry> Find(RegionId id) const;

  // The memfd of region `id` for `peer`, recorded as handed to it. `allowed` (the engine's
  // verdict, and whether the peer was dropped) runs under the same lock as Unserve, so a
  // revocation either sees the record or the request sees the revocation. Errors name why.
  struct Served {
    std::shared_ptr<const LocalRegionEntry> entry;
    LocalRegion exported;  // what `allowed` returned
    ShareableDup memfd;    // none when `pinned`
    // A device pinned the region's pages (src/util/pinned_ranges.h): revoking a mapping of
    // it would need a move that the device would not follow, so its memfd is not handed out
    // (nor recorded as served); the peer gets served copies instead.
    bool pinned = false;
  };
  absl::StatusOr<Served> Serve(RegionId id, PeerId peer,
                               absl::FunctionRef<absl::StatusOr<LocalRegion>()> allowed);
  // Forgets that `peer` was handed the memfd of `region` (every region if nullopt); returns
  // the bases of the buffers it had been handed (to revoke).
  std::vector<const std::byte*> Unserve(PeerId peer, std::optional<RegionId> region);

 private:
  mutable Mutex mu_;
  absl::flat_hash_map<RegionId, std::shared_ptr<const LocalRegionEntry>> regions_
      ABSL_GUARDED_BY(mu_);
  // Held by Serve across the verdict, the record and the duplicate, and by Unserve.
  Mutex serve_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::flat_hash_map<RegionId, absl::flat_hash_set<PeerId>> served_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_LOCAL_REGIONS_H_
