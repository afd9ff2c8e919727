// Drives transfers through one engine: several threads, each keeping a fixed number of
// transfers in flight, a warm-up, then a measured run of a fixed count or a fixed time. What
// each transfer moves comes from a callback, so raw messages and kv requests share it.
#ifndef KVWIRE_PERF_PUMP_H_
#define KVWIRE_PERF_PUMP_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "kvwire/engine.h"
#include "perf/report.h"
#include "perf/results.h"

namespace kvwire::perf {

struct PumpSpec {
  OpKind kind = OpKind::kWrite;
  // Every other transfer of each thread (the odd ones) is the opposite operation, so that
  // bytes flow both ways at once (kvwire-perf -b).
  bool bidirectional = false;
  int threads = 1;
  int outstanding = 1;
  uint64_t warmup_transfers = 0;  // per thread
  uint64_t transfers = 0;         // per thread; 0: run for duration_s
  double duration_s = 0;
  // Fills `ops` with transfer number `index` (warm-up included) of `thread`.
  std::function<void(int thread, uint64_t index, std::vector<Op>* ops)> make_ops;
  std::string label;  // for the progress line, e.g. "65536 B"
};

struct PumpResult {
  std::vector<TransferSample> samples;         // measured transfers of all threads
  double seconds = 0;                          // first measured submission to last completion
  std::vector<uint64_t> transfers_per_thread;  // warm-up included
  // Page faults of this process (every thread) from the start of the measurement to its end:
  // a first touch of memory inside the timed run shows here.
  long minor_faults = 0;
  long major_faults = 0;
};

absl::StatusOr<PumpResult> Pump(Engine& engine, PeerId peer, const PumpSpec& spec,
                                ProgressLine* progress);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_PUMP_H_
