// Which sanitizer this translation unit is built with, for tests that plant a sanitizer
// report on purpose: KVWIRE_TEST_ASAN, KVWIRE_TEST_TSAN (0 or 1), for gcc and clang.
#ifndef KVWIRE_TESTS_SUPPORT_SANITIZER_BUILD_H_
#define KVWIRE_TESTS_SUPPORT_SANITIZER_BUILD_H_

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVWIRE_TEST_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define KVWIRE_TEST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(KVWIRE_TEST_ASAN)
#define KVWIRE_TEST_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__) && !defined(KVWIRE_TEST_TSAN)
#define KVWIRE_TEST_TSAN 1
#endif
#ifndef KVWIRE_TEST_ASAN
#define KVWIRE_TEST_ASAN 0
#endif
#ifndef KVWIRE_TEST_TSAN
#define KVWIRE_TEST_TSAN 0
#endif

#endif  // KVWIRE_TESTS_SUPPORT_SANITIZER_BUILD_H_
