// The connector's request accounting: outcome counters, per-group bytes and ops, and the
// records of recent requests, behind a lock of its own. Lock order: taken under the
// connector's state lock (Connector::Impl::mu_) when a request retires, and alone by nothing
// else; it calls nothing while held (a leaf).
#ifndef KVWIRE_CONNECTOR_CONNECTOR_METRICS_H_
#define KVWIRE_CONNECTOR_CONNECTOR_METRICS_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "src/util/mutex.h"

namespace kvwire::connector_internal {

struct GroupCounters {
  uint64_t bytes = 0;
  uint64_t ops_before_merge = 0;
  uint64_t ops = 0;
};

class ConnectorMetrics {
 public:
  // Balances: started = completed + failed + released + withdrawn + live requests.
  struct Snapshot {
    uint64_t started = 0;
    uint64_t completed = 0;
    uint64_t failed = 0;
    uint64_t withdrawn = 0;      // dropped by the scheduler before any transfer
    uint64_t released = 0;       // prefill: held blocks the reader freed without reading
    uint64_t lease_expired = 0;  // read-mode holds no reader released (of failed)
    // read_start for a transfer id this prefill does not hold (unknown or released): refused,
    // no grant given.
    uint64_t reads_refused = 0;
    double transfer_seconds = 0;
    std::map<std::string, GroupCounters> group_totals;  // of completed requests
    nlohmann::json recent = nlohmann::json::array();    // the last kRecent retired requests
  };
  static constexpr size_t kRecent = 256;

  void Started() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    ++s_.started;
  }
  void Withdrawn() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    ++s_.withdrawn;
  }
  void LeaseExpired() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    ++s_.lease_expired;
  }
  void ReadRefused() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    ++s_.reads_refused;
  }
  enum class Outcome { kCompleted, kFailed, kReleased };
  // A request ended: counted by outcome, its groups added to the totals when it completed,
  // its `record` kept among the recent ones.
  void Retired(Outcome outcome, const std::map<std::string, GroupCounters>& groups,
               double transfer_seconds, nlohmann::json record) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    const bool completed = outcome == Outcome::kCompleted;
    ++(completed ? s_.completed : outcome == Outcome::kReleased ? s_.released : s_.failed);
    if (completed) {
      for (const auto& [g, c] : groups) {
        GroupCounters& t = s_.group_totals[g];
        t.bytes += c.bytes;
        t.ops_before_merge += c.ops_before_merge;
        t.ops += c.ops;
      }
    }
    s_.transfer_seconds += transfer_seconds;
    s_.recent.push_back(std::move(record));
    if (s_.recent.size() > kRecent) s_.recent.erase(s_.recent.begin());
  }
  Snapshot Get() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return s_;
  }

 private:
  mutable Mutex mu_;
  Snapshot s_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::connector_internal

#endif  // KVWIRE_CONNECTOR_CONNECTOR_METRICS_H_
