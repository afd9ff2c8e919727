#include "src/core/grant_table.h"

#include <algorithm>
#include <iterator>

#include "absl/random/distributions.h"
#include "absl/strings/str_cat.h"

namespace kvwire::core {

GrantId GrantTable::Add(PeerId peer, absl::Span<const GrantRange> ranges) {
  Ranges merged;
  for (const GrantRange& r : ranges) {
    std::map<uint64_t, uint64_t>& m = merged[r.region];
    uint64_t begin = r.offset;
    uint64_t end = r.offset + r.length;  // the caller checked it against the region
    // Absorbs every range that overlaps or touches [begin, end).
    auto it = m.upper_bound(begin);
    if (it != m.begin() && std::prev(it)->second >= begin) --it;
    while (it != m.end() && it->first <= end) {
      begin = std::min(begin, it->first);
      end = std::max(end, it->second);
      it = m.erase(it);
    }
    m.emplace(begin, end);
  }
  MutexLock lock(&mu_);
  // Unpredictable, so that a peer cannot name a grant it was not told (a grant made while its
  // request ended is revoked right after it is made: its id must not be guessable meanwhile);
  // never 0 (no grant) and never one that is live for this peer.
  GrantId id = 0;
  while (id == 0 || grants_.contains(GrantKey{peer, id})) id = absl::Uniform<GrantId>(bitgen_);
  grants_.emplace(GrantKey{peer, id}, std::move(merged));
  return id;
}

absl::Status GrantTable::Remove(PeerId peer, GrantId grant) {
  MutexLock lock(&mu_);
  if (grants_.erase(GrantKey{peer, grant}) == 0) {
    return absl::NotFoundError(absl::StrCat("grant ", grant, " is not live for peer ", peer));
  }
  return absl::OkStatus();
}

void GrantTable::ForgetPeer(PeerId peer) {
  MutexLock lock(&mu_);
  for (auto it = grants_.begin(); it != grants_.end();) {
    if (it->first.peer == peer) {
      grants_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::Status GrantTable::Check(PeerId peer, GrantId grant, RegionId region, uint64_t offset,
                               uint64_t length) const {
  if (grant == 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "region ", region, " is readable only under a grant, and the READ presented none"));
  }
  MutexLock lock(&mu_);
  auto g = grants_.find(GrantKey{peer, grant});
  if (g == grants_.end()) {
    // Unknown, revoked, or another peer's: the same answer (a peer learns nothing of others).
    return absl::PermissionDeniedError(
        absl::StrCat("grant ", grant, " is not live for this peer (unknown or revoked)"));
  }
  auto r = g->second.find(region);
  if (r != g->second.end()) {
    auto it = r->second.upper_bound(offset);
    if (it != r->second.begin()) {
      --it;
      // The caller checked offset + length against the region: no overflow.
      if (offset + length <= it->second) return absl::OkStatus();
    }
  }
  return absl::PermissionDeniedError(absl::StrCat("grant ", grant, " does not cover region ",
                                                  region, " bytes [", offset, ", ", offset + length,
                                                  ")"));
}

bool GrantTable::Live(PeerId peer, GrantId grant) const {
  MutexLock lock(&mu_);
  return grants_.contains(GrantKey{peer, grant});
}

uint64_t GrantTable::live() const {
  MutexLock lock(&mu_);
  return grants_.size();
}

absl::StatusOr<ResolvedRange> CheckIncoming(const RegionRegistry& regions, const GrantTable& grants,
                                            PeerId peer, RegionId region, uint64_t offset,
                                            uint64_t length, OpKind kind, GrantId grant,
                                            bool* grant_refused) {
  *grant_refused = false;
  absl::StatusOr<ResolvedRange> resolved =
      regions.ResolveForPeer(peer, region, offset, length, kind);
  if (!resolved.ok() || kind != OpKind::kRead || !resolved->reads_need_grant) return resolved;
  if (absl::Status granted = grants.Check(peer, grant, region, offset, length); !granted.ok()) {
    *grant_refused = true;
    return granted;
  }
  return resolved;
}

}  // namespace kvwire::core
