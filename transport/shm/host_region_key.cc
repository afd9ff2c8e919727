#include "transport/shm/host_region_key.h"

#include "absl/strings/str_cat.h"

#include "transport/shm/shm.pb.h"

namespace kvwire::transport::shm {

std::string EncodeHostRegionKey(bool shareable) {
  if (!shareable) return std::string();
  pb::ShmHostRegionKey key;
  key.set_shareable(true);
  return key.SerializeAsString();
}

absl::StatusOr<bool> ParseHostRegionKey(std::string_view key) {
  if (key.empty()) return false;
  pb::ShmHostRegionKey parsed;
  if (!parsed.ParseFromArray(key.data(), static_cast<int>(key.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a shm host region key (", key.size(), " bytes)"));
  }
  return parsed.shareable();
}

}  // namespace kvwire::transport::shm
