#include "src/core/grant_table.h"

#include <algorithm>
#include <iterator>
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
  access_epoch_.fetch_add(1, std::memory_order_release);
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
  access_epoch_.fetch_add(1, std::memory_order_release);
}

absl::Status GrantTable::Check(PeerId peer, GrantId grant, RegionId region, uint64_t offset,
                               uint64_t length) const {
  const GrantRange range{region, offset, length};
  absl::Status why;
  return CoveredPrefix(peer, grant, absl::MakeConstSpan(&range, 1), &why) == 1 ? absl::OkStatus()
                                                                               : why;
}

size_t GrantTable::CoveredPrefix(PeerId peer, GrantId grant, absl::Span<const GrantRange> ranges,
                                 absl::Status* why) const {
  if (ranges.empty()) return 0;
  if (grant == 0) {
    *why = absl::PermissionDeniedError(absl::StrCat("region ", ranges[0].region,
                                                    " is readable only under a grant, and the "
                                                    "READ presented none"));
    return 0;
  }
  MutexLock lock(&mu_);
  auto g = grants_.find(GrantKey{peer, grant});
  if (g == grants_.end()) {
    // Unknown, revoked, or another peer's: the same answer (a peer learns nothing of others).
    *why = absl::PermissionDeniedError(
        absl::StrCat("grant ", grant, " is not live for this peer (unknown or revoked)"));
    return 0;
  }
  const Spans& spans = g->second;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const GrantRange& r = ranges[i];
    // The last span that begins at or before (region, offset): the only one that can hold it.
    auto it = std::upper_bound(spans.begin(), spans.end(), std::pair(r.region, r.offset),
                               [](const std::pair<RegionId, uint64_t>& key, const Span& s) {
                                 return key.first != s.region ? key.first < s.region
                                                              : key.second < s.begin;
                               });
    // The caller checked offset + length against the region: no overflow.
    if (it != spans.begin() && std::prev(it)->region == r.region &&
        r.offset + r.length <= std::prev(it)->end) {
      continue;
    }
    *why = absl::PermissionDeniedError(absl::StrCat("grant ", grant, " does not cover region ",
                                                    r.region, " bytes [", r.offset, ", ",
                                                    r.offset + r.length, ")"));
    return i;
  }
  return ranges.size();
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

CheckedRun CheckIncomingRun(const RegionRegistry& regions, const GrantTable& grants, PeerId peer,
                            absl::Span<const transport::IncomingOp> ops, OpKind kind, GrantId grant,
                            absl::Span<transport::IncomingMemory> memory) {
  CheckedRun run;
  if (memory.size() < ops.size()) {
    run.refused = absl::InternalError(
        absl::StrCat("a run of ", ops.size(), " ops with room for ", memory.size()));
    return run;
  }
  // The ops of grant-guarded regions, for one check under the grant table's lock (inline
  // for a tcp read run, tcp_read_run.h's kMaxRunOps).
  absl::InlinedVector<GrantRange, 64> guarded;
  absl::InlinedVector<size_t, 64> guarded_op;
  const RegionEntry* entry = nullptr;  // the region of the op before (its pin is run.pins.back())
  RegionId entry_id = 0;
  size_t i = 0;
  for (; i < ops.size(); ++i) {
    const transport::IncomingOp& op = ops[i];
    if (entry != nullptr && op.region == entry_id) {
      if (absl::Status s =
              CheckBounds("remote", op.region, op.offset, op.length, entry->region.length);
          !s.ok()) {
        run.refused = std::move(s);
        break;
      }
    } else {
      absl::StatusOr<ResolvedRange> resolved =
          regions.ResolveForPeer(peer, op.region, op.offset, op.length, kind);
      if (!resolved.ok()) {
        run.refused = resolved.status();
        break;
      }
      run.pins.push_back(std::move(resolved->pin));
      entry = static_cast<const RegionEntry*>(run.pins.back().get());
      entry_id = op.region;
    }
    memory[i] = transport::IncomingMemory{entry->region.base + op.offset, entry->region.gpu_device};
    if (kind == OpKind::kRead && entry->region.reads_need_grant) {
      guarded.push_back(GrantRange{op.region, op.offset, op.length});
      guarded_op.push_back(i);
    }
  }
  run.passed = i;
  if (!guarded.empty()) {
    absl::Status why;
    const size_t covered = grants.CoveredPrefix(peer, grant, guarded, &why);
    if (covered < guarded.size()) {
      run.passed = guarded_op[covered];
      run.refused = std::move(why);
      run.grant_refused = true;
    }
    if (guarded_op[0] < run.passed) run.first_guarded = guarded_op[0];
  }
  return run;
}

}  // namespace kvwire::core
