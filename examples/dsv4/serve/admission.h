// Admission control of one model server's KV cache, like the waiting queue of vLLM's
// scheduler: a request whose blocks the cache cannot hold now waits, in arrival order, until
// finished requests (and prefill's read-mode hand-offs, once released or expired) give blocks
// back. It is refused only when the queue is full, or when it has waited its deadline, with
// the reason (and the group that lacked blocks) named, and a Retry-After for the client.
//
// What a request needs is counted per cache group (state groups: one slot) for its whole
// life, before anything is allocated: a decode or local generation reserves the blocks of
// prompt + max_tokens, so a request that was admitted never fails half way for lack of a
// block, and one that was not holds nothing. The head of the queue blocks those behind it
// (strict arrival order: a long prompt is not starved by a stream of short ones).
//
// One thread (the model server's worker) owns the queue; Stats are read from any thread.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_ADMISSION_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_ADMISSION_H_

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "kvwire/layout.h"
#include "src/util/mutex.h"

namespace dsv4::serve {

// Blocks (state groups: slots) per cache group name.
using BlockCounts = std::map<std::string, uint64_t>;

// What every group of `layout` needs for `num_tokens` tokens (as KvCache::Allocate takes).
BlockCounts BlocksNeeded(const kvwire::Layout& layout, uint64_t num_tokens);
// Blocks (slots) each group has in all.
BlockCounts Capacity(const kvwire::Layout& layout);
// `available` minus what a live request that holds `held` still may take to reach `total`.
void SubtractGrowth(const BlockCounts& total, const kvwire::BlockTable& held,
                    BlockCounts* available);
// The first group where `need` exceeds `available`, as "group 'g': N needed, M available";
// empty when it fits.
std::string Shortfall(const BlockCounts& need, const BlockCounts& available);

// Memory of the cache as configured, for the server's start-up line and its documentation.
struct CacheFootprint {
  uint64_t block_bytes = 0;  // one block of every paged group, over all its layers
  uint64_t slot_bytes = 0;   // one slot of every state group, over all its layers
  uint64_t blocks = 0;       // blocks per paged group
  uint64_t slots = 0;        // slots per state group
  uint64_t total_bytes = 0;
};
CacheFootprint Footprint(const kvwire::Layout& layout);

struct AdmissionOptions {
  // Requests waiting at once; one more is refused. Each holds its parsed request (prompt:
  // at most max_seq_len bytes) and one open connection of the HTTP server.
  size_t max_queue = 128;
  // How long a request may wait for blocks before it is refused.
  absl::Duration max_wait = absl::Seconds(30);
  // What refused clients are told to wait before they retry.
  absl::Duration retry_after = absl::Seconds(1);
};

enum class Rejection : int {
  kQueueFull = 0,  // the queue held max_queue requests
  kWaitDeadline,   // max_wait passed before the blocks came
  kTooLarge,       // more than the whole cache: it would never fit
  kClientGone,     // the client closed its connection while waiting
  kShutdown,       // the server stopped while it waited
};
inline constexpr int kNumRejections = 5;
// "queue_full", "wait_deadline", "too_large", "client_gone", "shutdown".
const char* RejectionName(Rejection r);

// Counters of the queue, readable from any thread.
class AdmissionStats {
 public:
  void Queued(size_t length);
  // `blocked`: it did not fit when it came (it waited for blocks, not just its turn).
  void Admitted(absl::Duration waited, bool blocked, size_t length);
  void Rejected(Rejection why, size_t length);

  // Prometheus text (kvwire_dsv4_admission_*), each series labelled engine="<engine>".
  std::string Prometheus(const std::string& engine) const;
  // {"queue_length", "max_queue", "admitted", "waited" (admitted after waiting for blocks),
  //  "wait_ms_sum", "wait_ms_max", "rejected": {reason: n}}
  nlohmann::json Json(size_t max_queue) const;
  size_t queue_length() const;

 private:
  // Upper bounds (seconds) of the wait histogram's buckets; the last is +Inf.
  static constexpr std::array<double, 10> kBounds = {0.001, 0.005, 0.01, 0.05, 0.1,
                                                     0.5,   1,     5,    10,   30};
  mutable kvwire::Mutex mu_;
  size_t length_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t admitted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t waited_ ABSL_GUARDED_BY(mu_) = 0;  // admitted after a Pump that left them waiting
  double wait_sum_s_ ABSL_GUARDED_BY(mu_) = 0;
  double wait_max_s_ ABSL_GUARDED_BY(mu_) = 0;
  std::array<uint64_t, kBounds.size() + 1> buckets_ ABSL_GUARDED_BY(mu_) = {};
  std::array<uint64_t, kNumRejections> rejected_ ABSL_GUARDED_BY(mu_) = {};
};

// The waiting queue. `Job` is the server's unit of work; it is moved in on Offer and out
// to exactly one of the callbacks of Pump or Drain.
template <typename Job>
class AdmissionQueue {
 public:
  AdmissionQueue(AdmissionOptions options, BlockCounts capacity)
      : options_(options), capacity_(std::move(capacity)) {}

  const AdmissionOptions& options() const { return options_; }
  const AdmissionStats& stats() const { return stats_; }
  size_t size() const { return waiting_.size(); }

  // Queues `job` needing `need`. Refused (and `job` left with the caller): InvalidArgument
  // when `need` exceeds the whole cache, ResourceExhausted when the queue is full; the
  // message names the reason and the setting that bounds it.
  absl::Status Offer(Job& job, BlockCounts need, absl::Time arrived) {
    if (std::string s = Shortfall(need, capacity_); !s.empty()) {
      stats_.Rejected(Rejection::kTooLarge, waiting_.size());
      return absl::InvalidArgumentError(
          absl::StrCat("the request needs more KV blocks than this server's whole cache (", s,
                       " in all; see --num-blocks and --max-requests)"));
    }
    if (waiting_.size() >= options_.max_queue) {
      stats_.Rejected(Rejection::kQueueFull, waiting_.size());
      return absl::ResourceExhaustedError(
          absl::StrCat("server overloaded: the admission queue is full (", options_.max_queue,
                       " requests wait for KV blocks; --max-queue)"));
    }
    waiting_.push_back(
        Entry{std::move(job), std::move(need), arrived, arrived + options_.max_wait, false});
    stats_.Queued(waiting_.size());
    return absl::OkStatus();
  }

  // Refuses the requests whose client went away (`gone(job)`); admits from the head while
  // the head fits what `available()` reports (called again after every admission):
  // `admit(job)`, which must allocate what it was admitted for before it returns; then
  // refuses the requests still waiting whose deadline passed `now` (each `refuse(job, why,
  // message)`), and admits again behind them. A request that fits is never refused for the
  // time it waited for its turn (the worker computing earlier ones), only one that waited for
  // blocks.
  template <typename Available, typename Gone, typename Admit, typename Refuse>
  void Pump(absl::Time now, Available available, Gone gone, Admit admit, Refuse refuse) {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (!gone(it->job)) {
        ++it;
        continue;
      }
      Entry e = std::move(*it);
      it = waiting_.erase(it);
      stats_.Rejected(Rejection::kClientGone, waiting_.size());
      refuse(e.job, Rejection::kClientGone, "the client went away while it waited");
    }
    while (true) {
      while (!waiting_.empty() && Shortfall(waiting_.front().need, available()).empty()) {
        Entry e = std::move(waiting_.front());
        waiting_.pop_front();
        stats_.Admitted(now - e.arrived, e.blocked, waiting_.size());
        admit(e.job);
      }
      bool expired = false;
      BlockCounts avail;
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (now <= it->deadline) {
          ++it;
          continue;
        }
        if (!expired) avail = available();
        expired = true;
        Entry e = std::move(*it);
        it = waiting_.erase(it);
        stats_.Rejected(Rejection::kWaitDeadline, waiting_.size());
        const std::string why = Shortfall(e.need, avail);
        refuse(e.job, Rejection::kWaitDeadline,
               absl::StrCat("server overloaded: waited ", absl::FormatDuration(now - e.arrived),
                            " for KV blocks (",
                            why.empty() ? "behind a request that waits for them" : why,
                            "; --max-queue-wait-s)"));
      }
      if (!expired) break;
    }
    for (Entry& e : waiting_) e.blocked = true;
  }

  // Hands every waiting job to `refuse` (shutdown).
  template <typename Refuse>
  void Drain(Refuse refuse) {
    while (!waiting_.empty()) {
      Entry e = std::move(waiting_.front());
      waiting_.pop_front();
      stats_.Rejected(Rejection::kShutdown, waiting_.size());
      refuse(e.job, Rejection::kShutdown, "server is shutting down");
    }
  }

 private:
  struct Entry {
    Job job;
    BlockCounts need;
    absl::Time arrived, deadline;
    bool blocked = false;  // a Pump left it waiting for blocks
  };
  const AdmissionOptions options_;
  const BlockCounts capacity_;
  std::deque<Entry> waiting_;
  AdmissionStats stats_;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_ADMISSION_H_
