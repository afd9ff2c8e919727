#include "perf/results.h"

#include <algorithm>
#include <cmath>

namespace kvwire::perf {

double Percentile(std::vector<double> values, double pct) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = pct / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(values.size() - 1, lo + 1);
  return values[lo] + (values[hi] - values[lo]) * (rank - static_cast<double>(lo));
}

void Summarize(std::vector<TransferSample> samples, double seconds, int window, Result* out) {
  out->transfers = samples.size();
  out->seconds = seconds;
  uint64_t bytes = 0, ops = 0;
  double post = 0;
  std::vector<double> latency;
  latency.reserve(samples.size());
  for (const TransferSample& s : samples) {
    bytes += s.bytes;
    ops += s.ops;
    post += s.post_us;
    latency.push_back((s.end_s - s.start_s) * 1e6);
  }
  out->ops = ops;
  if (samples.empty() || seconds <= 0) return;
  out->bw_avg_gbs = static_cast<double>(bytes) / seconds / 1e9;
  out->msg_rate_mops = static_cast<double>(ops) / seconds / 1e6;
  out->post_avg_us = post / static_cast<double>(samples.size());
  double sum = 0;
  for (double l : latency) sum += l;
  out->lat_avg_us = sum / static_cast<double>(latency.size());
  out->lat_p50_us = Percentile(latency, 50);
  out->lat_p99_us = Percentile(latency, 99);

  // Peak: the best rate over `window` consecutive completions (never below the average).
  std::sort(samples.begin(), samples.end(),
            [](const TransferSample& a, const TransferSample& b) { return a.end_s < b.end_s; });
  out->bw_peak_gbs = out->bw_avg_gbs;
  const size_t w = static_cast<size_t>(std::max(1, window));
  if (samples.size() > w) {
    uint64_t in_window = 0;
    for (size_t i = 1; i <= w; ++i) in_window += samples[i].bytes;
    for (size_t i = w; i < samples.size(); ++i) {
      if (i > w) in_window += samples[i].bytes - samples[i - w].bytes;
      const double dt = samples[i].end_s - samples[i - w].end_s;
      if (dt > 0) out->bw_peak_gbs = std::max(out->bw_peak_gbs, in_window / dt / 1e9);
    }
  }
}

}  // namespace kvwire::perf
