#include "src/util/fault_injection.h"

#include <atomic>

namespace kvwire::fault_injection {
namespace {

std::atomic<int> armed[kSites];

}  // namespace

void ArmPayloadFlips(Site site, int count) {
  armed[static_cast<int>(site)].store(count < 0 ? 0 : count, std::memory_order_release);
}

int PayloadFlipsLeft(Site site) {
  return armed[static_cast<int>(site)].load(std::memory_order_acquire);
}

bool MaybeFlipPayloadByte(Site site, void* data, uint64_t length) {
  std::atomic<int>& a = armed[static_cast<int>(site)];
  if (length == 0 || a.load(std::memory_order_relaxed) <= 0) return false;
  // Take one flip; another thread may have taken the last one meanwhile.
  int left = a.load(std::memory_order_relaxed);
  while (left > 0 && !a.compare_exchange_weak(left, left - 1, std::memory_order_acq_rel)) {
  }
  if (left <= 0) return false;
  static_cast<unsigned char*>(data)[length / 2] ^= 0x20;
  return true;
}

}  // namespace kvwire::fault_injection
