// Deterministic contents shared by the integration tests and their peer process, so that
// either side can verify bytes it did not write itself.
#ifndef KVWIRE_TESTS_INTEGRATION_TEST_PATTERN_H_
#define KVWIRE_TESTS_INTEGRATION_TEST_PATTERN_H_

#include <cstddef>
#include <cstdint>

namespace kvwire::testing {

inline std::byte PatternByte(uint64_t seed, uint64_t region_index, uint64_t offset) {
  const uint64_t x = seed * 131 + region_index * 31 + offset * 7 + (offset >> 8) * 13;
  return static_cast<std::byte>(x & 0xff);
}

inline void FillPattern(std::byte* data, uint64_t length, uint64_t seed, uint64_t region_index) {
  for (uint64_t i = 0; i < length; ++i) data[i] = PatternByte(seed, region_index, i);
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
