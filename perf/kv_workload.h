// The kv workload: whole requests' KV moved as the connector would move them, from a layout
// preset (dsv4-pro, dsv4-flash, v3-mla, mha), a prompt length, a share of fragmented blocks
// and a number of requests in flight.
#ifndef KVWIRE_PERF_KV_WORKLOAD_H_
#define KVWIRE_PERF_KV_WORKLOAD_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "perf/perf_options.h"
#include "perf/report.h"
#include "perf/results.h"
#include "perf/side_channel.h"

namespace kvwire::perf {

// The kv workload's pool size and request plans (one per request slot: --threads x
// --requests), exactly as both kvwire-perf sides build them, without an engine or memory:
// kvwire-memcpy-floor copies the same ranges for an independent floor.
struct KvPlans {
  uint64_t bytes = 0;  // each side's pool, ranges' offsets from its start
  std::vector<TransferPlan> plans;
};
absl::StatusOr<KvPlans> BuildKvPlans(const PerfOptions& options);

class KvSide {
 public:
  // Builds the layout and its backing memory for one side and registers it.
  static absl::StatusOr<std::unique_ptr<KvSide>> Create(const PerfOptions& options, Engine& engine,
                                                        bool initiator);
  virtual ~KvSide() = default;
  virtual RegionId region() const = 0;
  // Target: one RUN/DONE exchange (`run` is the split RUN line), waiting at most `timeout`
  // for DONE. InvalidArgument: the initiator's lines were not the protocol's.
  virtual absl::Status Serve(LineSocket& sock, const std::vector<std::string>& run,
                             absl::Duration timeout) = 0;
  // Initiator: runs the workload against the target's region and returns the table row.
  virtual absl::StatusOr<Result> Run(Engine& engine, PeerId peer, RegionId remote, LineSocket& sock,
                                     ProgressLine* progress) = 0;
};

// --dump-ranges: writes the first request slot's byte ranges of the kv workload `options`
// describes to options.dump_ranges_file, as text: a header line "kvwire-kv-ranges BYTES
// RANGES REQUEST_BYTES OPS_BEFORE_MERGE" (BYTES: the buffer each side needs; the ranges'
// addresses are offsets in it), then one "SRC DST LENGTH" line per range (prefill offset,
// decode offset, bytes). The same ranges the initiator hands its engine; no engine is made.
absl::Status DumpKvRanges(const PerfOptions& options);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_KV_WORKLOAD_H_
