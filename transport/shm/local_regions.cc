#include "transport/shm/local_regions.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <fcntl.h>
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
#include "src/util/pinned_ranges.h"
#include "transport/shm/errno_text.h"

namespace kvwire::transport::shm {
namespace {

// OK when `fd` (size `file_size`) may be handed to peers of `region`; seals it for that
// first if no seals were fixed yet. See LocalRegionTable::Add.
absl::Status SealForPeers(int fd, const LocalRegion& region, uint64_t memfd_offset,
                          uint64_t file_size) {
  const std::string who = absl::StrCat("shm: region ", region.id);
  if (memfd_offset != 0 || region.length != file_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, " is part of its memfd (offset ", memfd_offset, ", ", region.length, " of ", file_size,
        " bytes): the descriptor would give peers the rest of the memfd too; "
        "register a whole ShareableBuffer (data(), size()) to share it over shm"));
  }
  const bool read_only = (region.access & kRemoteWrite) == 0;
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals >= 0 && (seals & F_SEAL_SEAL) == 0) {
    if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL | (read_only ? F_SEAL_FUTURE_WRITE : 0)) != 0) {
      return ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno,
                         absl::StrCat(who, ": sealing its memfd for peers"));
    }
    seals = ::fcntl(fd, F_GET_SEALS);
  }
  if (seals < 0) {
    return ErrnoStatus(absl::StatusCode::kFailedPrecondition, errno,
                       absl::StrCat(who, ": reading its memfd's seals"));
  }
  if ((seals & F_SEAL_GROW) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": its memfd is not sealed against growing"));
  }
  const bool write_sealed = (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0;
  if (read_only && !write_sealed) {
    return absl::FailedPreconditionError(
        absl::StrCat(who,
                     " is read-only for peers, but its memfd's seals (fixed when it was first "
                     "registered read-write) let any holder write it"));
  }
  if (!read_only && write_sealed) {
    return absl::FailedPreconditionError(
        absl::StrCat(who,
                     " is writable for peers, but its memfd is sealed against writes (it was first "
                     "registered read-only)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LocalRegionTable::Add(const LocalRegion& region,
                                   std::optional<ShareableBacking> backing) {
  auto entry = std::make_shared<LocalRegionEntry>();
  entry->id = region.id;
  entry->length = region.length;
  entry->access = region.access;
  entry->base = region.base;
  entry->memfd_backed = backing.has_value();
  if (backing.has_value()) {
    entry->memfd_offset = backing->offset;
    entry->buffer = backing->buffer;
    // Checked and sealed through a duplicate; not kept (each serve looks the memfd up again,
    // so that a revoked one is never handed out).
    UniqueFd memfd(::fcntl(backing->fd, F_DUPFD_CLOEXEC, 0));
    if (!memfd.valid()) {
      return ErrnoStatus(
          absl::StatusCode::kInvalidArgument, errno,
          absl::StrCat("shm: region ", region.id, ": duplicating memfd ", backing->fd));
    }
    struct stat info;
    if (::fstat(memfd.get(), &info) != 0) {
      return ErrnoStatus(absl::StatusCode::kInvalidArgument, errno,
                         absl::StrCat("shm: region ", region.id, ": fstat of memfd"));
    }
    const uint64_t file_size = static_cast<uint64_t>(info.st_size);
    if (backing->offset > file_size || region.length > file_size - backing->offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm: region ", region.id, " (offset ", backing->offset, ", length ", region.length,
          ") extends past the end of its memfd (", file_size, " bytes)"));
    }
    const int seals = ::fcntl(memfd.get(), F_GET_SEALS);
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm: region ", region.id, ": memfd ", backing->fd,
          " is not sealed against shrinking (a peer's mapping could fault); allocate the "
          "memory with kvwire::ShareableBuffer"));
    }
    if (absl::Status shared = SealForPeers(memfd.get(), region, backing->offset, file_size);
        !shared.ok()) {
      entry->not_shared = std::string(shared.message());
      KVW_LOG(kWarning, "shm") << "memfd not shared with peers; they will reach the region "
                                  "over a validated transport"
                               << Kv("region", region.id) << Kv("reason", entry->not_shared);
    } else {
      entry->shared = true;
    }
  }
  MutexLock lock(&mu_);
  if (!regions_.try_emplace(region.id, std::move(entry)).second) {
    return absl::AlreadyExistsError(
        absl::StrCat("shm: region ", region.id, " is already registered"));
  }
  return absl::OkStatus();
}

const std::byte* LocalRegionTable::Remove(RegionId id) {
  std::shared_ptr<const LocalRegionEntry> removed;
  MutexLock serving(&serve_mu_);
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return nullptr;
  removed = std::move(it->second);
  regions_.erase(it);
  auto served = served_.find(id);
  if (served == served_.end()) return nullptr;
  const bool handed_out = !served->second.empty();
  served_.erase(served);
  return handed_out ? removed->base : nullptr;
}

void LocalRegionTable::Clear() {
  absl::flat_hash_map<RegionId, std::shared_ptr<const LocalRegionEntry>> removed;
  MutexLock serving(&serve_mu_);
  MutexLock lock(&mu_);
  removed.swap(regions_);
  served_.clear();
}

std::shared_ptr<const LocalRegionEntry> LocalRegionTable::Find(RegionId id) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

absl::StatusOr<LocalRegionTable::Served> LocalRegionTable::Serve(
    RegionId id, PeerId peer, absl::FunctionRef<absl::StatusOr<LocalRegion>()> allowed) {
  MutexLock serving(&serve_mu_);
  absl::StatusOr<LocalRegion> exported = allowed();
  if (!exported.ok()) return exported.status();
  std::shared_ptr<const LocalRegionEntry> entry = Find(id);
  if (entry == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("shm: region ", id, " is not registered with the shm transport"));
  }
  if (!entry->not_shared.empty()) return absl::FailedPreconditionError(entry->not_shared);
  if (!entry->shared) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm: region ", id,
        " is not memfd-backed (allocate it with kvwire::ShareableBuffer to share it over shm)"));
  }
  absl::StatusOr<std::optional<ShareableDup>> memfd =
      DupShareable(entry->base, entry->length, entry->buffer, /*with_epoch=*/true);
  if (!memfd.ok()) return memfd.status();
  if (!memfd->has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm: region ", id, ": the ShareableBuffer it was registered in no longer exists"));
  }
  // The descriptor reaches the whole buffer, so the whole buffer is what must not be pinned
  // (as a revocation's move checks it). Checked under serve_mu_, as Unserve runs: pinned now,
  // never handed out (the duplicate is closed here).
  if (AnyPinned(entry->base - (**memfd).offset, (**memfd).size)) {
    return Served{std::move(entry), *std::move(exported), ShareableDup{}, /*pinned=*/true};
  }
  {
    // Recorded before the descriptor leaves: a revocation after this point moves the buffer.
    MutexLock lock(&mu_);
    served_[id].insert(peer);
  }
  return Served{std::move(entry), *std::move(exported), **std::move(memfd), /*pinned=*/false};
}

std::vector<const std::byte*> LocalRegionTable::Unserve(PeerId peer,
                                                        std::optional<RegionId> region) {
  std::vector<const std::byte*> bases;
  MutexLock serving(&serve_mu_);
  MutexLock lock(&mu_);
  for (auto& [id, peers] : served_) {
    if (region.has_value() && id != *region) continue;
    if (peers.erase(peer) == 0) continue;
    auto it = regions_.find(id);
    if (it == regions_.end()) continue;
    const std::byte* base = it->second->base;
    if (std::find(bases.begin(), bases.end(), base) == bases.end()) bases.push_back(base);
  }
  return bases;
}

}  // namespace kvwire::transport::shm
