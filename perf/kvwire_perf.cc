// kvwire-perf: the transfer perf tool. Run it without a host on the target and with the
// target's host on the initiator, like perftest (ib_write_bw): both sides take the same test
// options, compare them at connect time over a side channel, and the initiator prints a
// header block and one table row per size. See `kvwire-perf --help`.
#include <cstdio>
#include <cstdlib>
#include <signal.h>

#include "perf/initiator.h"
#include "perf/kv_workload.h"
#include "perf/perf_options.h"
#include "perf/target.h"

int main(int argc, char** argv) {
  absl::StatusOr<kvwire::perf::PerfOptions> options = kvwire::perf::ParsePerfOptions(argc, argv);
  if (!options.ok()) {
    std::fprintf(stderr, "kvwire-perf: %s\n\n%s", std::string(options.status().message()).c_str(),
                 kvwire::perf::UsageText().c_str());
    return 2;
  }
  if (options->help) {
    std::printf("%s", kvwire::perf::UsageText().c_str());
    return 0;
  }
  if (!options->dump_ranges_file.empty()) {
    const absl::Status dumped = kvwire::perf::DumpKvRanges(*options);
    if (!dumped.ok()) {
      std::fprintf(stderr, "kvwire-perf: %s\n", std::string(dumped.message()).c_str());
      return 1;
    }
    return 0;
  }
  signal(SIGPIPE, SIG_IGN);
  // The engine's informational logs would interleave with the table.
  setenv("KVWIRE_LOG_LEVEL", "warning", /*overwrite=*/0);
  return options->is_client() ? kvwire::perf::RunInitiator(*options)
                              : kvwire::perf::RunTarget(*options);
}
