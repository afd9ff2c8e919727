// Mapping: owns one mmap'ed range of a file and unmaps it exactly once.
#ifndef KVWIRE_TRANSPORT_SHM_MAPPING_H_
#define KVWIRE_TRANSPORT_SHM_MAPPING_H_

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"

namespace kvwire::transport::shm {

class Mapping {
 public:
  // Maps `length` bytes of `fd` starting at byte `offset` (any alignment: the mapping starts
  // at the page boundary below it) with MAP_SHARED and `prot`. `populate` prefaults the page
  // tables now (MAP_POPULATE) and then touches every page once through the new mapping (see
  // Prefault), so that the first copies through it cost what later ones do.
  static absl::StatusOr<Mapping> Create(int fd, uint64_t offset, uint64_t length, int prot,
                                        bool populate);

  Mapping() = default;
  Mapping(Mapping&& other) noexcept { *this = std::move(other); }
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { Reset(); }

  // The byte at `offset` of the file (not the page-aligned start of the mapping).
  std::byte* data() const { return data_; }
  uint64_t length() const { return length_; }
  void Reset();

 private:
  void* map_base_ = nullptr;
  size_t map_length_ = 0;
  std::byte* data_ = nullptr;
  uint64_t length_ = 0;
};

// Touches one word of every page of [base, base + length) (`base` page-aligned, the range
// inside the mapped file): a read, or with `writable` an atomic OR of zero, which writes the
// value it read back and so changes nothing even while the owner writes the page. Why: on
// some VMs (a PVM guest: perf/cpu/README.md) the first access to each page through a second
// mapping of a memfd costs ~10x a 4 KiB copy even after MAP_POPULATE, with no fault the guest
// sees; paid here, at map time, it is not paid by the first requests.
void Prefault(std::byte* base, size_t length, bool writable);

// The system page size (cached).
size_t PageSize();

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_MAPPING_H_
