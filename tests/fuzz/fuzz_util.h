// Small helpers shared by the fuzz targets (no dependency on libFuzzer's headers, so the same
// files build as corpus replays with gcc).
#ifndef KVWIRE_TESTS_FUZZ_FUZZ_UTIL_H_
#define KVWIRE_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace kvwire::fuzz {

// A property the target checks failed: abort, so that libFuzzer (and the replay) report it.
#define KVWIRE_FUZZ_CHECK(cond)                                                          \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

// Splits `data` at every occurrence of `separator` (which is dropped): how the targets that
// take a sequence of messages read one input.
inline std::vector<std::string_view> SplitInput(std::string_view data, std::string_view separator) {
  std::vector<std::string_view> parts;
  while (true) {
    const size_t at = data.find(separator);
    if (at == std::string_view::npos) break;
    parts.push_back(data.substr(0, at));
    data.remove_prefix(at + separator.size());
  }
  parts.push_back(data);
  return parts;
}

}  // namespace kvwire::fuzz

#endif  // KVWIRE_TESTS_FUZZ_FUZZ_UTIL_H_
