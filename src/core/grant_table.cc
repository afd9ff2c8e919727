#include "src/core/grant_table.h"

#include <algorithm>
#include <utility>

#include "absl/random/distributions.h"
#include "absl/strings/str_cat.h"

namespace kvwire::core {

GrantId GrantTable::Add(PeerId peer, absl::Span<const GrantRange> ranges) {
  Spans spans;
  spans.reserve(ranges.size());
  for (const GrantRange& r : ranges) {
    spans.push_back({r.region, r.offset, r.offset + r.length});  // the caller checked the end
  }
  const auto before = [](const Span& a, const Span& b) {
    return a.region != b.region ? a.region < b.region : a.begin < b.begin;
  };
  // A request's ranges mostly come in order already: then no sort at all.
  if (!std::is_sorted(spans.begin(), spans.end(), before)) {
    std::sort(spans.begin(), spans.end(), before);
  }
  // Absorbs every span that overlaps or touches the one before it (of its region).
  size_t kept = 0;
  for (const Span& s : spans) {
    if (kept > 0 && spans[kept - 1].region == s.region && s.begin <= spans[kept - 1].end) {
      spans[kept - 1].end = std::max(spans[kept - 1].end, s.end);
    } else {
      spans[kept++] = s;
    }
  }
  spans.resize(kept);
  MutexLock lock(&mu_);
  // Unpredictable, so that a peer cannot name a grant it was not told (a grant made while its
  // request ended is revoked right after it is made: its id must not be guessable meanwhile);
  // never 0 (no grant) and never one that is live for this peer.
  GrantId id = 0;
  while (id == 0 || grants_.contains(GrantKey{peer, id})) id = absl::Uniform<GrantId>(bitgen_);
  grants_.emplace(GrantKey{peer, id}, std::move(spans));
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
  // The last span that begins at or before (region, offset): the only one that can hold it.
  const Spans& spans = g->second;
  auto it =
      std::upper_bound(spans.begin(), spans.end(), std::pair(region, offset),
                       [](const std::pair<RegionId, uint64_t>& key, const Span& s) {
                         return key.first != s.region ? key.first < s.region : key.second < s.begin;
                       });
  if (it != spans.begin()) {
    --it;
    // The caller checked offset + length against the region: no overflow.
    if (it->region == region && offset + length <= it->end) return absl::OkStatus();
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
