// The kv workload when this build has no connector layouts (include/kvwire/layout.h without
// its implementation in src/connector/): a clear error instead of a link failure.
#include "perf/kv_workload.h"

namespace kvwire::perf {

absl::StatusOr<std::unique_ptr<KvSide>> KvSide::Create(const PerfOptions&, Engine&, bool) {
  return absl::UnimplementedError(
      "--workload kv needs the connector's layouts (issue 4), which this build does not have "
      "yet; --workload raw works");
}

}  // namespace kvwire::perf
