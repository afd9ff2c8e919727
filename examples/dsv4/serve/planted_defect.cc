#include "examples/dsv4/serve/planted_defect.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVWIRE_DSV4_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define KVWIRE_DSV4_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(KVWIRE_DSV4_ASAN)
#define KVWIRE_DSV4_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__) && !defined(KVWIRE_DSV4_TSAN)
#define KVWIRE_DSV4_TSAN 1
#endif

namespace dsv4::serve {

int CommitPlantedDefectIfAsked(int exit_code) {
  const char* ask = std::getenv("KVWIRE_DSV4_PLANT_SANITIZER_REPORT");
  if (ask == nullptr || std::strcmp(ask, "1") != 0) return exit_code;
  // `opaque` is 0 at run time but unknown to the compiler, so nothing is folded away.
  const int opaque = static_cast<int>(std::strlen(ask)) - 1;
#if defined(KVWIRE_DSV4_TSAN)
  int racy = 0;
  std::thread writer([&] { racy = 1; });  // unsynchronised with the write below
  racy = 2 + opaque;
  writer.join();
  std::fprintf(stderr, "planted race: racy=%d\n", racy);
#elif defined(KVWIRE_DSV4_ASAN)
  auto block = std::make_unique<char[]>(8);
  volatile char past_the_end = block[8 + opaque];
  std::fprintf(stderr, "planted overflow: read %d\n", past_the_end);
#else
  std::fprintf(stderr, "planted defect: none in a build without a sanitizer (%d)\n", opaque);
#endif
  return exit_code;
}

}  // namespace dsv4::serve
