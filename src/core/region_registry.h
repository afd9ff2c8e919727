// Local regions of an engine: bounds, permissions, which peers each one is exported to, and
// pins that keep a region registered while a transfer or an incoming op touches it.
#ifndef KVWIRE_CORE_REGION_REGISTRY_H_
#define KVWIRE_CORE_REGION_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "src/util/mutex.h"
#include "transport/transport.h"

namespace kvwire::core {

struct RegionEntry {
  transport::LocalRegion region;
  bool export_to_all = false;
  // Reachable by peers: set once every transport registered it (Publish). Before, a peer
  // that guessed its id finds it "not exported": e.g. shm must not hand out its memfd before
  // rdma pinned its pages (a pinned buffer is never mapped out, SECURITY-shm.md).
  bool published = true;
  absl::flat_hash_set<PeerId> exported_to;  // guarded by the registry's mutex
};

// A local range resolved for use; `pin` keeps the region registered until released.
struct ResolvedRange {
  std::byte* data = nullptr;
  int gpu_device = -1;  // >= 0: device memory (kGpu region)
  // The region's RegionEntry itself (callers read its fixed fields through it: the engine's
  // checks of further ops or ranges of the same region); never a wrapper.
  std::shared_ptr<const void> pin;
  bool reads_need_grant = false;  // RegionOptions::reads_need_grant
};

class RegionRegistry {
 public:
  // `published` false: peers do not reach it until Publish (the engine's RegisterMemory, once
  // every transport has registered it).
  RegionId Add(const transport::LocalRegion& region, bool export_to_all, bool published = true)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Publish(RegionId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the region; the returned pin lets the caller wait for users to finish.
  absl::StatusOr<std::shared_ptr<const RegionEntry>> Remove(RegionId id) ABSL_LOCKS_EXCLUDED(mu_);

  // Local use by this engine's own transfers: existence and bounds.
  absl::StatusOr<ResolvedRange> ResolveLocal(RegionId id, uint64_t offset, uint64_t length) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Remote use by `peer`: exported to it, bounds, permission for `kind`.
  // `for_op` false: a check only (Grant), not refused while the region is being moved.
  absl::StatusOr<ResolvedRange> ResolveForPeer(PeerId peer, RegionId id, uint64_t offset,
                                               uint64_t length, OpKind kind,
                                               bool for_op = true) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<transport::LocalRegion> ExportedRegion(PeerId peer, RegionId id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Marks regions exported to `peer`; returns their descriptors (NotFound for unknown ids).
  absl::StatusOr<std::vector<transport::LocalRegion>> ExportTo(PeerId peer,
                                                               const std::vector<RegionId>& ids)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Withdraws explicit exports to `peer` (all or none: FailedPrecondition for a region
  // exported to every peer, NotFound for one not exported to `peer`).
  absl::Status UnexportFrom(PeerId peer, const std::vector<RegionId>& ids) ABSL_LOCKS_EXCLUDED(mu_);
  // Regions exported to every peer.
  std::vector<transport::LocalRegion> ExportedToAll() const ABSL_LOCKS_EXCLUDED(mu_);
  // Peers a region was exported to explicitly.
  void ForgetPeer(PeerId peer) ABSL_LOCKS_EXCLUDED(mu_);

  // Moves of host memory under regions (shm revocation puts a buffer onto a fresh memfd,
  // TargetHooks::QuiesceRange). While [base, base + length) is being moved, ResolveLocal and
  // ResolveForPeer refuse every region overlapping it with a status IsRegionMoving recognizes,
  // so no new op of this engine starts on the range; BeginMove returns the regions overlapping
  // it, each pinned, so the caller can wait for the ops already running (their pins) to end.
  struct Move {
    uint64_t id = 0;
    std::vector<std::shared_ptr<const RegionEntry>> overlapping;
  };
  Move BeginMove(const std::byte* base, uint64_t length) ABSL_LOCKS_EXCLUDED(mu_);
  void EndMove(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no move is in progress (true) or `deadline` passes (false).
  bool WaitForMoves(absl::Time deadline) const ABSL_LOCKS_EXCLUDED(mu_);

  // Changes whenever a peer may lose access to a region (Remove, UnexportFrom, ForgetPeer,
  // BeginMove); an access checked while it held one value is still granted while it holds it
  // (tcp_read_run.h checks ahead and accepts later against it).
  uint64_t access_epoch() const { return access_epoch_.load(std::memory_order_acquire); }

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t gpu_regions() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  RegionId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Bumped under mu_ after the change it announces (so that a check made after reading it
  // sees the change).
  std::atomic<uint64_t> access_epoch_{0};
  absl::flat_hash_map<RegionId, std::shared_ptr<RegionEntry>> regions_ ABSL_GUARDED_BY(mu_);
  struct MovingRange {
    uint64_t id;
    uintptr_t begin, end;
  };
  // Empty but for the length of a move: the resolve paths test only empty().
  std::vector<MovingRange> moving_ ABSL_GUARDED_BY(mu_);
  uint64_t next_move_ ABSL_GUARDED_BY(mu_) = 1;
  mutable CondVar moves_done_;

  // The refusal, when `entry` overlaps a range being moved.
  absl::Status MovingLocked(const RegionEntry& entry) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

// Whether `status` is RegionRegistry's refusal of an op on a region being moved.
bool IsRegionMoving(const absl::Status& status);

// The error CheckBounds returns (out of line: only a failing op builds a message).
absl::Status BoundsError(const char* side, RegionId id, uint64_t offset, uint64_t length,
                         uint64_t region_length);

// Checks [offset, offset+length) against a region of `region_length` without overflow.
// Inline: a transfer checks every op on both sides (thousands per request over rdma).
inline absl::Status CheckBounds(const char* side, RegionId id, uint64_t offset, uint64_t length,
                                uint64_t region_length) {
  if (length != 0 && offset <= region_length && length <= region_length - offset) [[likely]] {
    return absl::OkStatus();
  }
  return BoundsError(side, id, offset, length, region_length);
}

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_REGION_REGISTRY_H_
