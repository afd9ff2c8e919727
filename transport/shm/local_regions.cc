#include "transport/shm/local_regions.h"

#include <sys/stat.h>

#include <cerrno>
#include <fcntl.h>
#include <utility>

#include "absl/strings/str_cat.h"

#include "transport/shm/errno_text.h"

namespace kvwire::transport::shm {

absl::Status LocalRegionTable::Add(const LocalRegion& region) {
  auto entry = std::make_shared<LocalRegionEntry>();
  entry->id = region.id;
  entry->length = region.length;
  entry->access = region.access;
  entry->memfd_offset = region.memfd_offset;
  if (region.memfd >= 0) {
    entry->memfd.Reset(::fcntl(region.memfd, F_DUPFD_CLOEXEC, 0));
    if (!entry->memfd.valid()) {
      return ErrnoStatus(
          absl::StatusCode::kInvalidArgument, errno,
          absl::StrCat("shm: region ", region.id, ": duplicating memfd ", region.memfd));
    }
    struct stat info;
    if (::fstat(entry->memfd.get(), &info) != 0) {
      return ErrnoStatus(absl::StatusCode::kInvalidArgument, errno,
                         absl::StrCat("shm: region ", region.id, ": fstat of memfd"));
    }
    const uint64_t file_size = static_cast<uint64_t>(info.st_size);
    if (region.memfd_offset > file_size || region.length > file_size - region.memfd_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm: region ", region.id, " (offset ", region.memfd_offset, ", length ", region.length,
          ") extends past the end of its memfd (", file_size, " bytes)"));
    }
    const int seals = ::fcntl(entry->memfd.get(), F_GET_SEALS);
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm: region ", region.id, ": memfd ", region.memfd,
          " is not sealed against shrinking (a peer's mapping could fault); allocate the "
          "memory with kvwire::ShareableBuffer"));
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
