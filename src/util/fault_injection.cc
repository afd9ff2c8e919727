#include "src/util/fault_injection.h"

#include <atomic>

namespace kvwire::fault_injection {
namespace {

std::atomic<int> armed[kSites];
std::atomic<int> qp_errors[2];

// Takes one unit of `a` if any is left.
bool TakeOne(std::atomic<int>& a) {
  if (a.load(std::memory_order_relaxed) <= 0) return false;
  int left = a.load(std::memory_order_relaxed);
  while (left > 0 && !a.compare_exchange_weak(left, left - 1, std::memory_order_acq_rel)) {
  }
  return left > 0;
}

}  // namespace

void ArmPayloadFlips(Site site, int count) {
  armed[static_cast<int>(site)].store(count < 0 ? 0 : count, std::memory_order_release);
}

int PayloadFlipsLeft(Site site) {
  return armed[static_cast<int>(site)].load(std::memory_order_acquire);
}

bool MaybeFlipPayloadByte(Site site, void* data, uint64_t length) {
  // Take one flip; another thread may have taken the last one meanwhile.
  if (length == 0 || !TakeOne(armed[static_cast<int>(site)])) return false;
  static_cast<unsigned char*>(data)[length / 2] ^= 0x20;
  return true;
}

void ArmQpErrors(QpEnd end, int count) {
  qp_errors[static_cast<int>(end)].store(count < 0 ? 0 : count, std::memory_order_release);
}

int QpErrorsLeft(QpEnd end) {
  return qp_errors[static_cast<int>(end)].load(std::memory_order_acquire);
}

bool TakeQpError(QpEnd end) { return TakeOne(qp_errors[static_cast<int>(end)]); }

}  // namespace kvwire::fault_injection
