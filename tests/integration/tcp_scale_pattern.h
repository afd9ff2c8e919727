// The byte patterns tcp_peer_scale_test and its peer program check transfers with: every
// (slot, area) pair has its own, so a byte that lands in the wrong place is seen.
#ifndef KVWIRE_TESTS_INTEGRATION_TCP_SCALE_PATTERN_H_
#define KVWIRE_TESTS_INTEGRATION_TCP_SCALE_PATTERN_H_

#include <cstddef>
#include <cstdint>

namespace kvwire::testing {

inline std::byte PatternByte(uint64_t i, uint64_t slot, uint64_t area) {
  return static_cast<std::byte>((i * 131 + slot * 7 + area * 53 + (i >> 8)) & 0xff);
}

inline void FillPattern(std::byte* p, uint64_t n, uint64_t slot, uint64_t area) {
  for (uint64_t i = 0; i < n; ++i) p[i] = PatternByte(i, slot, area);
}

inline bool CheckPattern(const std::byte* p, uint64_t n, uint64_t slot, uint64_t area) {
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] != PatternByte(i, slot, area)) return false;
  }
  return true;
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_INTEGRATION_TCP_SCALE_PATTERN_H_
