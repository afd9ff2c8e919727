#include "src/util/pinned_ranges.h"

#include <map>

#include "src/util/mutex.h"

namespace kvwire {
namespace {

struct Pins {
  Mutex mu;
  std::multimap<uintptr_t, size_t> ranges ABSL_GUARDED_BY(mu);  // base -> length
};

Pins& GetPins() {
  // Never destroyed: ranges released by static destructors at exit can still unpin.
  static Pins* const pins = new Pins();
  return *pins;
}

}  // namespace

PinnedRange::PinnedRange(const void* base, size_t length)
    : base_(reinterpret_cast<uintptr_t>(base)), length_(length) {
  if (length_ == 0) return;
  Pins& pins = GetPins();
  MutexLock lock(&pins.mu);
  pins.ranges.emplace(base_, length_);
}

PinnedRange& PinnedRange::operator=(PinnedRange&& other) noexcept {
  if (this != &other) {
    Reset();
    base_ = std::exchange(other.base_, 0);
    length_ = std::exchange(other.length_, 0);
  }
  return *this;
}

void PinnedRange::Reset() {
  if (length_ == 0) return;
  Pins& pins = GetPins();
  MutexLock lock(&pins.mu);
  auto [first, last] = pins.ranges.equal_range(base_);
  for (auto it = first; it != last; ++it) {
    if (it->second == length_) {
      pins.ranges.erase(it);
      break;
    }
  }
  base_ = 0;
  length_ = 0;
}

bool AnyPinned(const void* base, size_t length) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(base);
  const uintptr_t end = begin + length;
  Pins& pins = GetPins();
  MutexLock lock(&pins.mu);
  // Few ranges (one per registered host region): a scan is enough.
  for (const auto& [start, size] : pins.ranges) {
    if (start >= end) break;
    if (start + size > begin) return true;
  }
  return false;
}

}  // namespace kvwire
