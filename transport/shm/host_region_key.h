// The shm transport's region key for host memory (shm.proto's ShmHostRegionKey): whether a
// peer may map the region from its memfd. The shm transport alone knows a region's memfd
// (shareable_registry.h); the engine hands the key to peers as opaque bytes.
#ifndef KVWIRE_TRANSPORT_SHM_HOST_REGION_KEY_H_
#define KVWIRE_TRANSPORT_SHM_HOST_REGION_KEY_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvwire::transport::shm {

// The key of a host region; empty (no key) when it is not memfd-backed.
std::string EncodeHostRegionKey(bool shareable);

// Whether the peer's host region is memfd-backed; an empty key is not. InvalidArgument for
// bytes that are not a host region key.
absl::StatusOr<bool> ParseHostRegionKey(std::string_view key);

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_HOST_REGION_KEY_H_
