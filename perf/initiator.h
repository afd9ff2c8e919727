// The initiator (client) side of kvwire-perf: connects to the target, runs every size (or the
// kv workload), and prints the header block and the table.
#ifndef KVWIRE_PERF_INITIATOR_H_
#define KVWIRE_PERF_INITIATOR_H_

#include "perf/perf_options.h"

namespace kvwire::perf {

// Returns the process exit status (0 ok, 1 failed, 2 options refused).
int RunInitiator(const PerfOptions& options);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_INITIATOR_H_
