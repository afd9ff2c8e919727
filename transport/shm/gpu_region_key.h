// The shm transport's region key for GPU memory (Transport::RegionKey): what a peer on the
// same host needs to map a kGpu region, i.e. the IPC handle of the region's allocation and
// where the region lies in it. A fixed 112-byte little-endian record, versioned:
//
//   0  "KWG" + version (1)        4  backend (gpu::Backend)   5  reserved (3 bytes, zero)
//   8  device (int32, exporter)   12 PCI bus id (packed, 0xffffffff: unknown)
//   16 process nonce (uint64: tells the exporting process, which cannot open its own handle)
//   24 IPC handle (64 bytes)      88 offset of the region in the allocation (uint64)
//   96 allocation size (uint64)   104 region length (uint64)
#ifndef KVWIRE_TRANSPORT_SHM_GPU_REGION_KEY_H_
#define KVWIRE_TRANSPORT_SHM_GPU_REGION_KEY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

#include "src/gpu/runtime.h"

namespace kvwire::transport::shm {

inline constexpr size_t kGpuRegionKeyBytes = 112;
inline constexpr uint8_t kGpuRegionKeyVersion = 1;
inline constexpr uint32_t kUnknownPciBusId = 0xffffffffu;

struct GpuRegionKey {
  gpu::Backend backend = gpu::Backend::kNone;
  int32_t device = -1;
  uint32_t pci_bus_id = kUnknownPciBusId;
  uint64_t process_nonce = 0;
  gpu::IpcHandle handle;  // handle.backend == backend after parsing
  uint64_t offset = 0;
  uint64_t allocation_size = 0;
  uint64_t length = 0;
};

std::string EncodeGpuRegionKey(const GpuRegionKey& key);
// InvalidArgument naming what is wrong: size, magic, version, backend, device, or a region that
// does not lie inside its allocation.
absl::StatusOr<GpuRegionKey> ParseGpuRegionKey(std::string_view bytes);

// gpu::BackendName's words, here because this layer links none of src/gpu (its tests link
// the shm objects alone; the runtime is reached only through gpu::Runtime's virtual calls).
const char* GpuBackendWord(gpu::Backend backend);

// Random per process, never zero (so that a zeroed key never matches).
uint64_t ShmProcessNonce();
// "0000:3b:00.0" -> domain << 16 | bus << 8 | device << 3 | function; kUnknownPciBusId when
// the id is empty or malformed (or the domain does not fit in 16 bits).
uint32_t PackPciBusId(std::string_view bus_id);

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_GPU_REGION_KEY_H_
