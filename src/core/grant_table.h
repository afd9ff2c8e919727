// Read grants (Engine::Grant): which ranges of grant-guarded regions each peer may READ, under
// which grant id. The target checks every incoming READ of such a region here, so that a peer
// reads exactly what it was granted for one request, and nothing once the grant is revoked.
#ifndef KVWIRE_CORE_GRANT_TABLE_H_
#define KVWIRE_CORE_GRANT_TABLE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/types/span.h"

#include "kvwire/engine.h"
#include "src/core/region_registry.h"
#include "src/util/mutex.h"
#include "transport/transport.h"

namespace kvwire::core {

// A grant as the target knows it: the peer it was made to and its id (a peer presenting
// another peer's id matches nothing). GrantTable's and ServedOps's maps are keyed by it.
struct GrantKey {
  PeerId peer;
  GrantId grant;
  bool operator==(const GrantKey&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const GrantKey& k) {
    return H::combine(std::move(h), k.peer, k.grant);
  }
};

class GrantTable {
 public:
  // Records a grant of `ranges` (already validated against their regions) to `peer`.
  GrantId Add(PeerId peer, absl::Span<const GrantRange> ranges) ABSL_LOCKS_EXCLUDED(mu_);
  // NotFound when `grant` is not live for `peer`.
  absl::Status Remove(PeerId peer, GrantId grant) ABSL_LOCKS_EXCLUDED(mu_);
  // Every grant of a closed peer.
  void ForgetPeer(PeerId peer) ABSL_LOCKS_EXCLUDED(mu_);
  // OK when `grant` is live for `peer` and one of its ranges holds [offset, offset+length) of
  // `region`; PermissionDenied naming what is missing otherwise.
  absl::Status Check(PeerId peer, GrantId grant, RegionId region, uint64_t offset,
                     uint64_t length) const ABSL_LOCKS_EXCLUDED(mu_);
  // Check of each of `ranges` in order, under one lock: how many leading ranges it holds
  // (ranges.size() when all), and *why the next one is refused.
  size_t CoveredPrefix(PeerId peer, GrantId grant, absl::Span<const GrantRange> ranges,
                       absl::Status* why) const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t live() const ABSL_LOCKS_EXCLUDED(mu_);
  // Changes whenever a grant goes (Remove, ForgetPeer), as RegionRegistry::access_epoch.
  uint64_t access_epoch() const { return access_epoch_.load(std::memory_order_acquire); }
  // `grant` is live for `peer` (not revoked, its peer not forgotten).
  bool Live(PeerId peer, GrantId grant) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // [begin, end) of one region.
  struct Span {
    RegionId region;
    uint64_t begin;
    uint64_t end;
  };
  // A grant's spans, sorted by (region, begin) and merged (no two of a region touch), so a
  // check is one binary search. One vector per grant, not a tree node per range: a dsv4-pro
  // request grants ~3,000 ranges, and Add runs once per reader of every request.
  using Spans = std::vector<Span>;

  mutable Mutex mu_;
  std::atomic<uint64_t> access_epoch_{0};  // bumped under mu_ after the removal
  absl::BitGen bitgen_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<GrantKey, Spans> grants_ ABSL_GUARDED_BY(mu_);
};

// The target's access check for one incoming op, the one place it is written (the engine's
// TargetHooks::ResolveIncoming and the tcp_wire fuzz target call it): the region's existence,
// export, bounds and permission, then, for a READ of a grant-guarded region, the grant.
// `*grant_refused` tells the caller that the grant, not the range, refused it.
absl::StatusOr<ResolvedRange> CheckIncoming(const RegionRegistry& regions, const GrantTable& grants,
                                            PeerId peer, RegionId region, uint64_t offset,
                                            uint64_t length, OpKind kind, GrantId grant,
                                            bool* grant_refused);

// CheckIncoming for the ops of a run served together (transport::TargetHooks::
// ResolveIncomingRun): checks stop at the first op refused. An op of the region of the op
// before it is checked for bounds only, against the entry the run's pin holds (the rest
// depends on the region alone; a region unexported during the run is as one unexported just
// after its check); the grant is checked for the ops of grant-guarded regions under one lock.
struct CheckedRun {
  size_t passed = 0;           // ops [0, passed) passed every check
  absl::Status refused;        // why op `passed` did not (OK when every op passed)
  bool grant_refused = false;  // the grant, not the range, refused it
  // The first op that passed on a grant-guarded region (a READ), SIZE_MAX if none did.
  size_t first_guarded = SIZE_MAX;
  // The regions of the ops (RegionEntry pins), a region once per run of its ops.
  absl::InlinedVector<std::shared_ptr<const void>, 2> pins;
};
CheckedRun CheckIncomingRun(const RegionRegistry& regions, const GrantTable& grants, PeerId peer,
                            absl::Span<const transport::IncomingOp> ops, OpKind kind, GrantId grant,
                            absl::Span<transport::IncomingMemory> memory);

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_GRANT_TABLE_H_
