// Deterministic contents shared by the integration tests and their peer process, so that
// either side can verify bytes it did not write itself.
#ifndef KVWIRE_TESTS_INTEGRATION_TEST_PATTERN_H_
#define KVWIRE_TESTS_INTEGRATION_TEST_PATTERN_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvwire::testing {

// A keyed hash (splitmix64) of (seed, region, absolute offset / 8): the contents never
// repeat at any offset, so a piece moved to the wrong place — by any distance, including a
// multiple of a page or of 64 KiB — or an overrun into a gap is always seen.
inline uint64_t PatternWord(uint64_t seed, uint64_t region_index, uint64_t word_index) {
  uint64_t z =
      word_index + seed * 0x9e3779b97f4a7c15ull + (region_index + 1) * 0xd1b54a32d192ed03ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline std::byte PatternByte(uint64_t seed, uint64_t region_index, uint64_t offset) {
  return static_cast<std::byte>(
      (PatternWord(seed, region_index, offset / 8) >> (8 * (offset % 8))) & 0xff);
}

inline void FillPattern(std::byte* data, uint64_t length, uint64_t seed, uint64_t region_index) {
  for (uint64_t i = 0; i < length; ++i) data[i] = PatternByte(seed, region_index, i);
}

// Offset of the first byte where `a` and `b` differ, or -1 when all `length` are equal
// (memcmp first: whole-buffer comparisons stay cheap under sanitizers and in the VM).
inline int64_t FirstDifference(const std::byte* a, const std::byte* b, uint64_t length) {
  if (std::memcmp(a, b, length) == 0) return -1;
  for (uint64_t i = 0; i < length; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

inline uint64_t Fnv1a(const std::byte* data, uint64_t length) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < length; ++i) {
    h ^= static_cast<uint8_t>(data[i]);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_INTEGRATION_TEST_PATTERN_H_
