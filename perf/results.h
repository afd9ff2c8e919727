// What one measurement (one size, or one kv run) produced, and how raw samples become the
// numbers of the table: average and peak bandwidth, message rate, latency percentiles.
#ifndef KVWIRE_PERF_RESULTS_H_
#define KVWIRE_PERF_RESULTS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace kvwire::perf {

// One completed transfer, as the initiator saw it.
struct TransferSample {
  double start_s = 0;  // submission, seconds since the measurement started
  double end_s = 0;    // completion seen
  double post_us = 0;  // time inside Engine::Transfer
  uint64_t bytes = 0;
  uint64_t ops = 0;
};

struct Result {
  uint64_t bytes = 0;  // per op (raw) or per request (kv)
  uint64_t ops = 0;    // ops measured (all threads)
  uint64_t transfers = 0;
  double seconds = 0;
  double bw_avg_gbs = 0;   // decimal GB/s
  double bw_peak_gbs = 0;  // best window of consecutive completions
  double msg_rate_mops = 0;
  double lat_avg_us = 0;  // per transfer, submission to completion
  double lat_p50_us = 0;
  double lat_p99_us = 0;
  double post_avg_us = 0;     // time inside Transfer() (shm copies there)
  std::string check = "off";  // off | ok | the error
  // kv workload only.
  uint64_t requests = 0;
  double requests_per_s = 0;
  uint64_t ops_before_merge = 0;  // per request, as the layout maps it
  uint64_t ops_after_merge = 0;   // per request, after the connector's merge
  uint64_t ops_posted = 0;        // per request, after the engine's merge and split
  double floor_ms = 0;            // bytes / floor bandwidth, when known
};

// Fills the bandwidth, rate and latency fields from the samples of all threads.
// `seconds` is the measured wall time (first submission to last completion).
void Summarize(std::vector<TransferSample> samples, double seconds, int window, Result* out);

// Exact percentile (0..100) of unsorted values; 0 when empty.
double Percentile(std::vector<double> values, double pct);

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_RESULTS_H_
