// kvwire::ShareableBuffer (declared in include/kvwire/memory.h): host memory in a sealed memfd,
// mapped MAP_SHARED, so that the shm transport can hand the fd to a peer on the same host.
#include <sys/mman.h>

#include <cerrno>
#include <fcntl.h>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#include "kvwire/memory.h"
#include "transport/shm/errno_text.h"
#include "transport/shm/mapping.h"
#include "transport/shm/shareable_registry.h"
#include "transport/shm/unique_fd.h"

namespace kvwire {

absl::StatusOr<ShareableBuffer> ShareableBuffer::Create(size_t length, const std::string& name) {
  using transport::shm::ErrnoStatus;
  if (length == 0) return absl::InvalidArgumentError("ShareableBuffer of 0 bytes");
  const size_t page = transport::shm::PageSize();
  if (length > SIZE_MAX - (page - 1)) {
    return absl::InvalidArgumentError(absl::StrCat("ShareableBuffer of ", length, " bytes"));
  }
  const size_t size = (length + page - 1) & ~(page - 1);
  // memfd names are for /proc/<pid>/fd and debugging only; the kernel limits them to 249 bytes.
  const std::string memfd_name = name.substr(0, 200);
  transport::shm::UniqueFd fd(::memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno,
                       absl::StrCat("memfd_create(\"", memfd_name, "\")"));
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno,
                       absl::StrCat("ftruncate of memfd \"", memfd_name, "\" to ", size, " bytes"));
  }
  // A peer that maps this memfd must not be able to hit SIGBUS because the file shrank under
  // it: seal the size for good, and let the receiving side check the seals. F_SEAL_SEAL is
  // left to the shm transport: it adds F_SEAL_FUTURE_WRITE first when the memory is
  // registered read-only (LocalRegionTable::Add), so that no holder of the descriptor can
  // write it, and then forbids further seals.
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, errno,
                       absl::StrCat("sealing memfd \"", memfd_name, "\""));
  }
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (data == MAP_FAILED) {
    return ErrnoStatus(absl::StatusCode::kResourceExhausted, errno,
                       absl::StrCat("mmap of memfd \"", memfd_name, "\" (", size, " bytes)"));
  }
  transport::shm::RegisterShareable(data, size, fd.get());
  return ShareableBuffer(static_cast<std::byte*>(data), size, fd.Release());
}

ShareableBuffer::ShareableBuffer(ShareableBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

ShareableBuffer& ShareableBuffer::operator=(ShareableBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    // The mapping does not move, so the registry entry (keyed by address) stays valid.
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

ShareableBuffer::~ShareableBuffer() { Reset(); }

void ShareableBuffer::Reset() {
  if (data_ != nullptr) {
    // Unregister first, so that FindShareable never returns a descriptor about to close.
    transport::shm::UnregisterShareable(data_);
    ::munmap(data_, size_);
  }
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  size_ = 0;
  fd_ = -1;
}

}  // namespace kvwire
