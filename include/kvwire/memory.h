// Memory kinds, access rights, and shareable host memory for the shm transport.
#ifndef KVWIRE_MEMORY_H_
#define KVWIRE_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvwire {

enum class MemoryKind : uint32_t {
  kHost = 0,
  kGpu = 1,
};

// What a peer may do to a region. Local access is always allowed.
enum Access : uint32_t {
  kAccessNone = 0,
  kRemoteRead = 1,
  kRemoteWrite = 2,
  kRemoteReadWrite = 3,
};

// Host memory backed by a memfd, so that a peer engine on the same host can map it once and
// move data with one memcpy. Move-only; unmaps and closes on destruction. Any part of it can
// be registered with Engine::RegisterMemory: the engine finds the backing memfd itself.
class ShareableBuffer {
 public:
  // Allocates `length` bytes (rounded up to the page size), zero-filled.
  static absl::StatusOr<ShareableBuffer> Create(size_t length, const std::string& name = "kvwire");

  ShareableBuffer() = default;
  ShareableBuffer(ShareableBuffer&& other) noexcept;
  ShareableBuffer& operator=(ShareableBuffer&& other) noexcept;
  ShareableBuffer(const ShareableBuffer&) = delete;
  ShareableBuffer& operator=(const ShareableBuffer&) = delete;
  ~ShareableBuffer();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }

 private:
  ShareableBuffer(std::byte* data, size_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  void Reset();

  std::byte* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

}  // namespace kvwire

#endif  // KVWIRE_MEMORY_H_
