// UniqueFd: owns one file descriptor and closes it exactly once.
#ifndef KVWIRE_TRANSPORT_SHM_UNIQUE_FD_H_
#define KVWIRE_TRANSPORT_SHM_UNIQUE_FD_H_

#include <unistd.h>
#include <utility>

namespace kvwire::transport::shm {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership without closing.
  int Release() { return std::exchange(fd_, -1); }
  void Reset(int fd = -1) {
    // close(2) is not retried on EINTR: on Linux the descriptor is released either way, and a
    // retry could close a descriptor another thread just received.
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_UNIQUE_FD_H_
