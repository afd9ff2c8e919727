// Clock reads without a library's layers: one clock_gettime (a vDSO call, no system call for
// the realtime, monotonic and CPU-time clocks) and integer nanoseconds.
#ifndef KVWIRE_UTIL_CLOCK_H_
#define KVWIRE_UTIL_CLOCK_H_

#include <cstdint>
#include <time.h>

namespace kvwire {

inline int64_t ClockNanos(clockid_t clock) {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// Nanoseconds since the Unix epoch: absl::GetCurrentTimeNanos's units (absl::FromUnixNanos
// makes an absl::Time of it) at about half its instructions, on the path of every transfer.
inline int64_t UnixNanos() { return ClockNanos(CLOCK_REALTIME); }

}  // namespace kvwire

#endif  // KVWIRE_UTIL_CLOCK_H_
