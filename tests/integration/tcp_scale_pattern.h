// The byte patterns tcp_peer_scale_test and its peer program check transfers with: every
// (slot, area) pair has its own, so a byte that lands in the wrong place is seen.
#ifndef KVWIRE_TESTS_INTEGRATION_TCP_SCALE_PATTERN_H_
#define KVWIRE_TESTS_INTEGRATION_TCP_SCALE_PATTERN_H_

#include <cstddef>
#include <cstdint>

namespace kvwire::testing {

// splitmix64 of (slot, area, word): no two (slot, area) pairs share a stream, for any number of
// peers (a linear mix repeated every 256 slots, and shifted copies of one area matched others).
inline uint64_t PatternWord(uint64_t word, uint64_t slot, uint64_t area) {
  uint64_t z = (slot << 40) ^ (area << 32) ^ word;
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline std::byte PatternByte(uint64_t i, uint64_t slot, uint64_t area) {
  return static_cast<std::byte>(PatternWord(i / 8, slot, area) >> (8 * (i % 8)));
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
