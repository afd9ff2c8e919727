#include "examples/dsv4/serve/admission.h"

#include <algorithm>

#include "src/util/prometheus_text.h"

namespace dsv4::serve {

using nlohmann::json;

namespace {

uint64_t LayerBytes(const kvwire::CacheGroup& g) {
  return g.page_bytes * static_cast<uint64_t>(std::max(1, g.components)) * g.layers.size();
}

}  // namespace

BlockCounts BlocksNeeded(const kvwire::Layout& layout, uint64_t num_tokens) {
  BlockCounts need;
  for (const kvwire::CacheGroup& g : layout.groups) {
    if (g.per_request_state) {
      need[g.name] = 1;
    } else {
      const uint64_t per = static_cast<uint64_t>(std::max(1, g.tokens_per_block));
      need[g.name] = (num_tokens + per - 1) / per;
    }
  }
  return need;
}

BlockCounts Capacity(const kvwire::Layout& layout) {
  BlockCounts c;
  for (const kvwire::CacheGroup& g : layout.groups) c[g.name] = g.num_blocks;
  return c;
}

void SubtractGrowth(const BlockCounts& total, const kvwire::BlockTable& held,
                    BlockCounts* available) {
  for (const auto& [group, n] : total) {
    uint64_t have = 0;
    if (auto it = held.find(group); it != held.end()) {
      have = static_cast<uint64_t>(
          std::count_if(it->second.begin(), it->second.end(), [](int64_t b) { return b >= 0; }));
    }
    if (n <= have) continue;
    uint64_t& a = (*available)[group];
    a -= std::min(a, n - have);
  }
}

std::string Shortfall(const BlockCounts& need, const BlockCounts& available) {
  for (const auto& [group, n] : need) {
    auto it = available.find(group);
    const uint64_t a = it == available.end() ? 0 : it->second;
    if (n > a) return absl::StrCat("group '", group, "': ", n, " needed, ", a, " available");
  }
  return "";
}

CacheFootprint Footprint(const kvwire::Layout& layout) {
  CacheFootprint f;
  for (const kvwire::CacheGroup& g : layout.groups) {
    if (g.per_request_state) {
      f.slot_bytes += LayerBytes(g);
      f.slots = std::max(f.slots, g.num_blocks);
    } else {
      f.block_bytes += LayerBytes(g);
      f.blocks = std::max(f.blocks, g.num_blocks);
    }
    f.total_bytes += LayerBytes(g) * g.num_blocks;
  }
  return f;
}

const char* RejectionName(Rejection r) {
  switch (r) {
    case Rejection::kQueueFull:
      return "queue_full";
    case Rejection::kWaitDeadline:
      return "wait_deadline";
    case Rejection::kTooLarge:
      return "too_large";
    case Rejection::kClientGone:
      return "client_gone";
    case Rejection::kShutdown:
      return "shutdown";
  }
  return "?";
}

void AdmissionStats::Queued(size_t length) {
  kvwire::MutexLock lock(&mu_);
  length_ = length;
}

void AdmissionStats::Admitted(absl::Duration waited, bool blocked, size_t length) {
  const double s = std::max(0.0, absl::ToDoubleSeconds(waited));
  kvwire::MutexLock lock(&mu_);
  length_ = length;
  ++admitted_;
  if (blocked) ++waited_;
  wait_sum_s_ += s;
  wait_max_s_ = std::max(wait_max_s_, s);
  size_t b = 0;
  while (b < kBounds.size() && s > kBounds[b]) ++b;
  ++buckets_[b];
}

void AdmissionStats::Rejected(Rejection why, size_t length) {
  kvwire::MutexLock lock(&mu_);
  length_ = length;
  ++rejected_[static_cast<int>(why)];
}

size_t AdmissionStats::queue_length() const {
  kvwire::MutexLock lock(&mu_);
  return length_;
}

std::string AdmissionStats::Prometheus(const std::string& engine) const {
  kvwire::MutexLock lock(&mu_);
  const std::string e = absl::StrCat("engine=\"", kvwire::PrometheusLabelValue(engine), "\"");
  std::string m;
  absl::StrAppend(&m,
                  "# HELP kvwire_dsv4_admission_queue_length Requests waiting in the admission "
                  "queue for KV blocks.\n",
                  "# TYPE kvwire_dsv4_admission_queue_length gauge\n",
                  "kvwire_dsv4_admission_queue_length{", e, "} ", length_, "\n");
  absl::StrAppend(&m,
                  "# HELP kvwire_dsv4_admission_wait_seconds Seconds admitted requests waited "
                  "for KV blocks.\n",
                  "# TYPE kvwire_dsv4_admission_wait_seconds histogram\n");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < kBounds.size(); ++i) {
    cumulative += buckets_[i];
    absl::StrAppend(&m, "kvwire_dsv4_admission_wait_seconds_bucket{", e, ",le=\"", kBounds[i],
                    "\"} ", cumulative, "\n");
  }
  cumulative += buckets_.back();
  absl::StrAppend(&m, "kvwire_dsv4_admission_wait_seconds_bucket{", e, ",le=\"+Inf\"} ", cumulative,
                  "\n", "kvwire_dsv4_admission_wait_seconds_sum{", e, "} ", wait_sum_s_, "\n",
                  "kvwire_dsv4_admission_wait_seconds_count{", e, "} ", admitted_, "\n");
  absl::StrAppend(&m,
                  "# HELP kvwire_dsv4_admission_waited_total Requests admitted after waiting "
                  "for KV blocks.\n",
                  "# TYPE kvwire_dsv4_admission_waited_total counter\n",
                  "kvwire_dsv4_admission_waited_total{", e, "} ", waited_, "\n");
  absl::StrAppend(&m,
                  "# HELP kvwire_dsv4_admission_rejected_total Requests refused by admission, "
                  "by reason.\n",
                  "# TYPE kvwire_dsv4_admission_rejected_total counter\n");
  for (int i = 0; i < kNumRejections; ++i) {
    absl::StrAppend(&m, "kvwire_dsv4_admission_rejected_total{", e, ",reason=\"",
                    RejectionName(static_cast<Rejection>(i)), "\"} ", rejected_[i], "\n");
  }
  return m;
}

json AdmissionStats::Json(size_t max_queue) const {
  kvwire::MutexLock lock(&mu_);
  json rejected = json::object();
  for (int i = 0; i < kNumRejections; ++i) {
    rejected[RejectionName(static_cast<Rejection>(i))] = rejected_[i];
  }
  return {{"queue_length", length_},
          {"max_queue", max_queue},
          {"admitted", admitted_},
          {"waited", waited_},
          {"wait_ms_sum", wait_sum_s_ * 1e3},
          {"wait_ms_max", wait_max_s_ * 1e3},
          {"rejected", rejected}};
}

}  // namespace dsv4::serve
