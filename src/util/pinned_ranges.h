// Host memory whose physical pages a device holds on to (rdma: ibv_reg_mr pins the pages a
// range is backed by when it is registered). Moving such a range onto other pages (the shm
// transport's revocation, transport/shm/shareable_registry.h) would leave the device reading
// and writing the old ones, so whoever moves memory asks first.
#ifndef KVWIRE_SRC_UTIL_PINNED_RANGES_H_
#define KVWIRE_SRC_UTIL_PINNED_RANGES_H_

#include <cstddef>
#include <cstdint>
#include <utility>

namespace kvwire {

// Marks [base, base + length) pinned while it lives. Move-only.
class PinnedRange {
 public:
  PinnedRange() = default;
  PinnedRange(const void* base, size_t length);
  PinnedRange(PinnedRange&& other) noexcept
      : base_(std::exchange(other.base_, 0)), length_(std::exchange(other.length_, 0)) {}
  PinnedRange& operator=(PinnedRange&& other) noexcept;
  PinnedRange(const PinnedRange&) = delete;
  PinnedRange& operator=(const PinnedRange&) = delete;
  ~PinnedRange() { Reset(); }
  void Reset();

 private:
  uintptr_t base_ = 0;
  size_t length_ = 0;
};

// Whether any live PinnedRange overlaps [base, base + length). Thread-safe.
bool AnyPinned(const void* base, size_t length);

}  // namespace kvwire

#endif  // KVWIRE_SRC_UTIL_PINNED_RANGES_H_
