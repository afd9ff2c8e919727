// The target (server) side of kvwire-perf: waits for one initiator, checks that both sides
// were given the same test, exposes its buffer, and verifies WRITEs when asked to.
#ifndef KVWIRE_PERF_TARGET_H_
#define KVWIRE_PERF_TARGET_H_

#include "perf/perf_options.h"

namespace kvwire::perf {

// Returns the process exit status (0 ok, 1 failed, 2 options refused).
int RunTarget(const PerfOptions& options);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_TARGET_H_
