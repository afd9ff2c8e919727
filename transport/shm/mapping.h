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
  // tables now, so that the first copy into the range does not pay one fault per page.
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

// The system page size (cached).
size_t PageSize();

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_MAPPING_H_
