// How many of this process's mappings are of memfds whose name starts with `name`
// (/proc/self/maps): whether a peer's shared memory, or a buffer of its own, is mapped here.
#ifndef KVWIRE_TESTS_SUPPORT_MEMFD_MAPPINGS_H_
#define KVWIRE_TESTS_SUPPORT_MEMFD_MAPPINGS_H_

#include <fstream>
#include <string>
#include <string_view>

namespace kvwire::testing {

inline int MemfdMappings(std::string_view name) {
  const std::string needle = "/memfd:" + std::string(name);
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find(needle) != std::string::npos) ++n;
  }
  return n;
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_MEMFD_MAPPINGS_H_
