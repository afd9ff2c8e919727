// The target (server) side of kvwire-perf: waits for one initiator, checks that both sides
// were given the same test, exposes its buffer, and verifies WRITEs when asked to.
#ifndef KVWIRE_PERF_TARGET_H_
#define KVWIRE_PERF_TARGET_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "perf/kv_workload.h"
#include "perf/perf_options.h"
#include "perf/session.h"
#include "perf/side_channel.h"

namespace kvwire::perf {

// Returns the process exit status (0 ok, 1 failed, 2 options refused).
int RunTarget(const PerfOptions& options);

// The pieces of RunTarget that read what the initiator sends (it is untrusted), exposed for
// tests/fuzz/perf_side_channel_fuzz.cc, which drives them on a socketpair.

// Reads the initiator's HELLO line and decodes its settings (RunTarget then checks they agree
// with this side's: CheckAgreement).
absl::StatusOr<std::map<std::string, std::string>> ReadHello(const PerfOptions& o,
                                                             LineSocket& sock);

// After the HELLO: RUN lines until BYE (OK) or an error; a malformed or refused request gets
// an ERROR line and the loop goes on. The raw workload serves `bytes` of host memory at
// `host` (null for GPU memory, which --check refuses); the kv workload serves `kv`.
absl::Status ServeInitiator(const PerfOptions& o, LineSocket& sock, std::byte* host, uint64_t bytes,
                            KvSide* kv);

// One RUN/DONE exchange of a raw test on `sock` (`run`: the RUN line's words).
absl::Status ServeSize(const PerfOptions& o, LineSocket& sock, std::byte* host, uint64_t bytes,
                       const std::vector<std::string>& run);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_TARGET_H_
