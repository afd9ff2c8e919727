#include "src/core/region_registry.h"

#include <cstdint>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

#include "transport/region_moving.h"

namespace kvwire::core {
bool IsRegionMoving(const absl::Status& status) { return transport::IsRegionMoving(status); }

absl::Status RegionRegistry::MovingLocked(const RegionEntry& entry) const {
  const auto begin = reinterpret_cast<uintptr_t>(entry.region.base);
  const uintptr_t end = begin + entry.region.length;
  for (const MovingRange& m : moving_) {
    if (begin < m.end && m.begin < end) {
      absl::Status refused = absl::UnavailableError(absl::StrCat(
          "region ", entry.region.id,
          " is being moved onto a fresh memfd (shm revocation of a peer's mapping); retry"));
      refused.SetPayload(transport::kRegionMovingPayload, absl::Cord("1"));
      return refused;
    }
  }
  return absl::OkStatus();
}

RegionRegistry::Move RegionRegistry::BeginMove(const std::byte* base, uint64_t length) {
  MutexLock lock(&mu_);
  const auto begin = reinterpret_cast<uintptr_t>(base);
  Move move{next_move_++, {}};
  moving_.push_back(MovingRange{move.id, begin, begin + length});
  for (const auto& [id, entry] : regions_) {
    const auto b = reinterpret_cast<uintptr_t>(entry->region.base);
    if (b < begin + length && begin < b + entry->region.length) move.overlapping.push_back(entry);
  }
  access_epoch_.fetch_add(1, std::memory_order_release);
  return move;
}

void RegionRegistry::EndMove(uint64_t id) {
  MutexLock lock(&mu_);
  std::erase_if(moving_, [id](const MovingRange& m) { return m.id == id; });
  if (moving_.empty()) moves_done_.SignalAll();
}

bool RegionRegistry::WaitForMoves(absl::Time deadline) const {
  MutexLock lock(&mu_);
  while (!moving_.empty()) {
    if (!moves_done_.WaitUntil(&mu_, deadline) && !moving_.empty()) return false;
  }
  return true;
}

absl::Status BoundsError(const char* side, RegionId id, uint64_t offset, uint64_t length,
                         uint64_t region_length) {
  if (length == 0) {
    return absl::InvalidArgumentError(absl::StrCat(side, " region ", id, ": zero-length op"));
  }
  if (offset > region_length || length > region_length - offset) {
    return absl::OutOfRangeError(absl::StrCat(side, " region ", id, ": offset ", offset, " length ",
                                              length, " exceeds region length ", region_length));
  }
  return absl::OkStatus();
}

RegionId RegionRegistry::Add(const transport::LocalRegion& region, bool export_to_all,
                             bool published) {
  MutexLock lock(&mu_);
  auto entry = std::make_shared<RegionEntry>();
  entry->region = region;
  entry->region.id = next_id_++;
  entry->export_to_all = export_to_all;
  entry->published = published;
  const RegionId id = entry->region.id;
  regions_.emplace(id, std::move(entry));
  return id;
}

void RegionRegistry::Publish(RegionId id) {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it != regions_.end()) it->second->published = true;
}

absl::StatusOr<std::shared_ptr<const RegionEntry>> RegionRegistry::Remove(RegionId id) {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("region ", id, " is not registered"));
  }
  std::shared_ptr<const RegionEntry> entry = std::move(it->second);
  regions_.erase(it);
  access_epoch_.fetch_add(1, std::memory_order_release);
  return entry;
}

absl::StatusOr<ResolvedRange> RegionRegistry::ResolveLocal(RegionId id, uint64_t offset,
                                                           uint64_t length) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("local region ", id, " is not registered"));
  }
  const RegionEntry& entry = *it->second;
  if (absl::Status s = CheckBounds("local", id, offset, length, entry.region.length); !s.ok()) {
    return s;
  }
  if (!moving_.empty()) [[unlikely]] {
    if (absl::Status s = MovingLocked(entry); !s.ok()) return s;
  }
  return ResolvedRange{entry.region.base + offset, entry.region.gpu_device, it->second};
}

absl::StatusOr<ResolvedRange> RegionRegistry::ResolveForPeer(PeerId peer, RegionId id,
                                                             uint64_t offset, uint64_t length,
                                                             OpKind kind, bool for_op) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || !it->second->published ||
      !(it->second->export_to_all || it->second->exported_to.contains(peer))) {
    // Unknown, unpublished and unexported look the same to a peer: it learns nothing it was
    // not given.
    return absl::NotFoundError(absl::StrCat("region ", id, " is not exported to peer ", peer));
  }
  const RegionEntry& entry = *it->second;
  const uint32_t needed = kind == OpKind::kRead ? kRemoteRead : kRemoteWrite;
  if ((entry.region.access & needed) == 0) {
    return absl::PermissionDeniedError(absl::StrCat("region ", id, " does not allow remote ",
                                                    kind == OpKind::kRead ? "READ" : "WRITE",
                                                    " (access bits ", entry.region.access, ")"));
  }
  if (absl::Status s = CheckBounds("remote", id, offset, length, entry.region.length); !s.ok()) {
    return s;
  }
  if (for_op && !moving_.empty()) [[unlikely]] {
    if (absl::Status s = MovingLocked(entry); !s.ok()) return s;
  }
  return ResolvedRange{entry.region.base + offset, entry.region.gpu_device, it->second,
                       entry.region.reads_need_grant};
}

absl::StatusOr<transport::LocalRegion> RegionRegistry::ExportedRegion(PeerId peer,
                                                                      RegionId id) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || !it->second->published ||
      !(it->second->export_to_all || it->second->exported_to.contains(peer))) {
    return absl::NotFoundError(absl::StrCat("region ", id, " is not exported to peer ", peer));
  }
  return it->second->region;
}

absl::StatusOr<std::vector<transport::LocalRegion>> RegionRegistry::ExportTo(
    PeerId peer, const std::vector<RegionId>& ids) {
  MutexLock lock(&mu_);
  for (RegionId id : ids) {
    if (!regions_.contains(id)) {
      return absl::NotFoundError(absl::StrCat("cannot export region ", id, ": not registered"));
    }
  }
  std::vector<transport::LocalRegion> out;
  for (RegionId id : ids) {
    RegionEntry& entry = *regions_[id];
    entry.exported_to.insert(peer);
    out.push_back(entry.region);
  }
  return out;
}

absl::Status RegionRegistry::UnexportFrom(PeerId peer, const std::vector<RegionId>& ids) {
  MutexLock lock(&mu_);
  for (RegionId id : ids) {
    auto it = regions_.find(id);
    if (it != regions_.end() && it->second->export_to_all) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot withdraw region ", id, " from peer ", peer, ": it is exported to all peers"));
    }
    if (it == regions_.end() || !it->second->exported_to.contains(peer)) {
      return absl::NotFoundError(
          absl::StrCat("cannot withdraw region ", id, ": not exported to peer ", peer));
    }
  }
  for (RegionId id : ids) regions_[id]->exported_to.erase(peer);
  access_epoch_.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

std::vector<transport::LocalRegion> RegionRegistry::ExportedToAll() const {
  MutexLock lock(&mu_);
  std::vector<transport::LocalRegion> out;
  for (const auto& [id, entry] : regions_) {
    if (entry->export_to_all && entry->published) out.push_back(entry->region);
  }
  return out;
}

void RegionRegistry::ForgetPeer(PeerId peer) {
  MutexLock lock(&mu_);
  for (auto& [id, entry] : regions_) entry->exported_to.erase(peer);
  access_epoch_.fetch_add(1, std::memory_order_release);
}

size_t RegionRegistry::size() const {
  MutexLock lock(&mu_);
  return regions_.size();
}

size_t RegionRegistry::gpu_regions() const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [id, entry] : regions_) n += entry->region.gpu_device >= 0 ? 1 : 0;
  return n;
}

uint64_t RegionRegistry::bytes() const {
  MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [id, entry] : regions_) total += entry->region.length;
  return total;
}

}  // namespace kvwire::core
