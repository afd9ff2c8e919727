// Process-wide registry of live ShareableBuffers, so that the engine can tell whether memory
// handed to RegisterMemory is memfd-backed (and which memfd, at which offset) without the
// caller saying so.
#ifndef KVWIRE_TRANSPORT_SHM_SHAREABLE_REGISTRY_H_
#define KVWIRE_TRANSPORT_SHM_SHAREABLE_REGISTRY_H_

#include <cstddef>
#include <cstdint>
#include <optional>

namespace kvwire::transport {

// Where a range of host memory lives inside a ShareableBuffer's memfd.
struct ShareableBacking {
  int fd = -1;          // owned by the ShareableBuffer: valid while it lives
  uint64_t offset = 0;  // offset of the range's first byte within the memfd
};

// Returns the backing of [ptr, ptr + length) if the whole range lies inside one live
// ShareableBuffer (length 0: ptr inside one), else nullopt. Thread-safe.
std::optional<ShareableBacking> FindShareable(const void* ptr, size_t length);

namespace shm {
// Called by ShareableBuffer only: [base, base + size) is backed by `fd` from offset 0.
void RegisterShareable(const void* base, size_t size, int fd);
void UnregisterShareable(const void* base);
}  // namespace shm

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_SHM_SHAREABLE_REGISTRY_H_
