// The target (server) side of kvwire-perf: waits for one initiator, checks that both sides
// were given the same test, exposes its buffer, and verifies WRITEs when asked to.
#ifndef KVWIRE_PERF_TARGET_H_
#define KVWIRE_PERF_TARGET_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

#include "perf/perf_options.h"
#include "perf/session.h"
#include "perf/side_channel.h"

namespace kvwire::perf {

// Returns the process exit status (0 ok, 1 failed, 2 options refused).
int RunTarget(const PerfOptions& options);

// One RUN/DONE exchange of a raw test on `sock` (`run`: the RUN line's words), serving
// `buffer`. Exposed for tests/fuzz/perf_side_channel_fuzz.cc: the initiator is untrusted.
absl::Status ServeSize(const PerfOptions& o, LineSocket& sock, LocalBuffer& buffer,
                       const std::vector<std::string>& run);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_TARGET_H_
