// Regions of the shm transport's tests, as the engine would hand them over: a LocalRegion of
// a test's buffer, and the RemoteRegionDesc a peer receives for it (with the key the target's
// RegionKey gives a host region; the engine forwards it as is). Shared by
// tests/unit/shm/shm_transport_test.cc and hostile_shm_test.cc.
#ifndef KVWIRE_TESTS_SUPPORT_SHM_REGIONS_H_
#define KVWIRE_TESTS_SUPPORT_SHM_REGIONS_H_

#include <cstddef>
#include <cstdint>

#include "transport/shm/host_region_key.h"
#include "transport/shm/shareable_registry.h"
#include "transport/transport.h"

namespace kvwire::testing {

inline transport::LocalRegion MakeRegion(RegionId id, std::byte* base, uint64_t length,
                                         uint32_t access) {
  transport::LocalRegion region;
  region.id = id;
  region.base = base;
  region.length = length;
  region.access = access;
  return region;
}

inline transport::RemoteRegionDesc Describe(const transport::LocalRegion& region) {
  transport::RemoteRegionDesc desc;
  desc.id = region.id;
  desc.length = region.length;
  desc.access = region.access;
  desc.kind = region.kind;
  desc.address = reinterpret_cast<uintptr_t>(region.base);
  desc.SetKey(transport::shm::EncodeHostRegionKey(
      transport::FindShareable(region.base, region.length).has_value()));
  return desc;
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_SHM_REGIONS_H_
