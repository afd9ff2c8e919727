#include "transport/shm/local_regions.h"

#include <sys/stat.h>

#include <cerrno>
#include <fcntl.h>
#include <utility>

#include "absl/strings/str_cat.h"

#include "src/util/log.h"
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
  entry->memfd_backed = backing.has_value();
  if (backing.has_value()) {
    entry->memfd_offset = backing->offset;
    entry->memfd.Reset(::fcntl(backing->fd, F_DUPFD_CLOEXEC, 0));
    if (!entry->memfd.valid()) {
      return ErrnoStatus(
          absl::StatusCode::kInvalidArgument, errno,
          absl::StrCat("shm: region ", region.id, ": duplicating memfd ", backing->fd));
    }
    struct stat info;
    if (::fstat(entry->memfd.get(), &info) != 0) {
      return ErrnoStatus(absl::StatusCode::kInvalidArgument, errno,
                         absl::StrCat("shm: region ", region.id, ": fstat of memfd"));
    }
    const uint64_t file_size = static_cast<uint64_t>(info.st_size);
    if (backing->offset > file_size || region.length > file_size - backing->offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm: region ", region.id, " (offset ", backing->offset, ", length ", region.length,
          ") extends past the end of its memfd (", file_size, " bytes)"));
    }
    const int seals = ::fcntl(entry->memfd.get(), F_GET_SEALS);
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm: region ", region.id, ": memfd ", backing->fd,
          " is not sealed against shrinking (a peer's mapping could fault); allocate the "
          "memory with kvwire::ShareableBuffer"));
    }
    if (absl::Status shared = SealForPeers(entry->memfd.get(), region, backing->offset, file_size);
        !shared.ok()) {
      entry->not_shared = std::string(shared.message());
      entry->memfd.Reset();
      KVW_LOG(kWarning, "shm") << "memfd not shared with peers; they will reach the region "
                                  "over a validated transport"
                               << Kv("region", region.id) << Kv("reason", entry->not_shared);
    }
  }
  MutexLock lock(&mu_);
  if (!regions_.try_emplace(region.id, std::move(entry)).second) {
    return absl::AlreadyExistsError(
        absl::StrCat("shm: region ", region.id, " is already registered"));
  }
  return absl::OkStatus();
}

void LocalRegionTable::Remove(RegionId id) {
  std::shared_ptr<const LocalRegionEntry> removed;  // closes the duplicate outside the lock
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return;
  removed = std::move(it->second);
  regions_.erase(it);
}

void LocalRegionTable::Clear() {
  absl::flat_hash_map<RegionId, std::shared_ptr<const LocalRegionEntry>> removed;
  MutexLock lock(&mu_);
  removed.swap(regions_);
}

std::shared_ptr<const LocalRegionEntry> LocalRegionTable::Find(RegionId id) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

}  // namespace kvwire::transport::shm
