#include "transport/shm/mapping.h"

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <unistd.h>

#include "absl/strings/str_cat.h"

#include "transport/shm/errno_text.h"

namespace kvwire::transport::shm {

size_t PageSize() {
  static const size_t page_size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page_size;
}

absl::StatusOr<Mapping> Mapping::Create(int fd, uint64_t offset, uint64_t length, int prot,
                                        bool populate) {
  if (length == 0) return absl::InvalidArgumentError("cannot map 0 bytes");
  const uint64_t page = PageSize();
  const uint64_t aligned_offset = offset & ~(page - 1);
  const uint64_t slack = offset - aligned_offset;
  if (length > SIZE_MAX - slack) {
    return absl::InvalidArgumentError(
        absl::StrCat("mapping of ", length, " bytes at offset ", offset, " is too large"));
  }
  const size_t map_length = static_cast<size_t>(slack + length);
  const int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
  void* base = ::mmap(nullptr, map_length, prot, flags, fd, static_cast<off_t>(aligned_offset));
  if (base == MAP_FAILED) {
    return ErrnoStatus(absl::StatusCode::kInternal, errno,
                       absl::StrCat("mmap of ", map_length, " bytes at offset ", aligned_offset));
  }
  if (populate) Prefault(static_cast<std::byte*>(base), map_length, (prot & PROT_WRITE) != 0);
  Mapping mapping;
  mapping.map_base_ = base;
  mapping.map_length_ = map_length;
  mapping.data_ = static_cast<std::byte*>(base) + slack;
  mapping.length_ = length;
  return mapping;
}

void Prefault(std::byte* base, size_t length, bool writable) {
  const size_t page = PageSize();
  for (size_t at = 0; at < length; at += page) {
    auto* word = reinterpret_cast<uint64_t*>(base + at);
    if (writable) {
      std::atomic_ref<uint64_t>(*word).fetch_or(0, std::memory_order_relaxed);
    } else {
      (void)std::atomic_ref<uint64_t>(*word).load(std::memory_order_relaxed);
    }
  }
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    Reset();
    map_base_ = std::exchange(other.map_base_, nullptr);
    map_length_ = std::exchange(other.map_length_, 0);
    data_ = std::exchange(other.data_, nullptr);
    length_ = std::exchange(other.length_, 0);
  }
  return *this;
}

void Mapping::Reset() {
  if (map_base_ != nullptr) ::munmap(map_base_, map_length_);
  map_base_ = nullptr;
  map_length_ = 0;
  data_ = nullptr;
  length_ = 0;
}

}  // namespace kvwire::transport::shm
