// Transfers in flight: lanes outstanding, first error wins, deadlines, waiters. A transfer's
// final state is reported once, then forgotten: to its end callback when it has one
// (TransferOptions::on_complete), else to Poll/Wait.
//
// Completion is pushed: ending a transfer wakes its waiters and queues its end callback for
// the engine's completion thread (RunEndCallbacks), and the engine's deadline thread sleeps
// until the earliest deadline (WaitForDeadline) instead of sweeping on a fixed period.
#ifndef KVWIRE_CORE_TRANSFER_TABLE_H_
#define KVWIRE_CORE_TRANSFER_TABLE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "src/util/mutex.h"
#include "src/util/spin_gate.h"

namespace kvwire::core {

struct TransferInfo {
  TransferId id = 0;
  PeerId peer = 0;
  OpKind kind = OpKind::kWrite;
  uint64_t bytes = 0;
  uint64_t pieces = 0;
  absl::InlinedVector<RegionId, 2> local_regions;  // inline: no allocation per transfer
  std::optional<std::string> notification;
  bool count_arrivals = false;
  absl::Time start;
  int64_t start_ns = 0;  // `start` in Unix nanoseconds (UnixNanos: latency stats)
  absl::Time deadline;
  int transport = -1;  // the index in Engine::Impl::transports_ it was routed over
};

// What happened when a transfer's last lane finished.
struct LanesDone {
  TransferInfo info;
  absl::Status status;  // first error of the lanes, or OK
  // LaneDone claimed the end for the caller (see LaneDone): it calls CompleteEnd, not
  // ClaimEnd.
  bool claimed = false;
};

// Called once with a transfer's final status (see TransferOptions::on_complete).
using EndCallback = std::function<void(TransferId, const absl::Status&)>;

class TransferTable {
 public:
  // Registers a transfer with `lanes` lanes to complete; returns its cancellation flag.
  // `on_end` (may be empty) receives the final status from RunEndCallbacks.
  // With `arm_deadline` false, the deadline is not watched until ArmDeadline: for a transfer
  // that its caller expects to end inline (EndInline), which then checks it itself.
  std::shared_ptr<std::atomic<bool>> Start(TransferInfo info, uint32_t lanes,
                                           EndCallback on_end = nullptr, bool arm_deadline = true)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Watches the deadline of a transfer started without it, unless it has ended (or is claimed)
  // already. A deadline already past expires at once.
  void ArmDeadline(TransferId id) ABSL_LOCKS_EXCLUDED(mu_);
  // The status of a transfer whose deadline passed.
  static absl::Status DeadlineError(const TransferInfo& info);
  // One lane finished. When it was the last and the transfer is still pending, returns the
  // transfer for the caller to finish (send its notification, then Finish). With
  // `claim_unless_notifying`, a transfer that failed or carries no notification (nothing left
  // to do but account for it) is claimed in the same step (LanesDone::claimed, as ClaimEnd),
  // which saves the caller a second trip through the table's lock.
  std::optional<LanesDone> LaneDone(TransferId id, absl::Status status,
                                    bool claim_unless_notifying = false) ABSL_LOCKS_EXCLUDED(mu_);
  // Sets the final status (first error wins: a transfer already failed stays failed).
  // Returns false when it had already ended.
  bool Finish(TransferId id, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // Finish in two steps, for a caller that must account for the transfer before any waiter
  // wakes (a Wait that returns sees the stats that count it). ClaimEnd makes the caller the
  // only one that may end the transfer (deadlines and FailIf skip it from then on) and is
  // false when it had already ended; CompleteEnd then ends it with `status`.
  bool ClaimEnd(TransferId id) ABSL_LOCKS_EXCLUDED(mu_);
  void CompleteEnd(TransferId id, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // The end of a one-lane transfer whose lane finished in the initiator's thread before
  // Engine::Transfer returned, in one step (LaneDone + ClaimEnd + CompleteEnd): nobody can wait
  // for it yet (its id is not out) and it has no end callback, so the caller may account for it
  // after this returns. False when it had ended already (deadline, peer death): whoever ended
  // it accounted for it. A transfer started without its deadline armed whose deadline is
  // past at `now` ends as the deadline thread would have ended it: *status becomes
  // DeadlineError (what the caller accounts for).
  bool EndInline(TransferId id, absl::Status* status, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Registers a transfer that has ended already with `status` (no lanes out, no deadline):
  // for Wait and Poll to report once, like any other.
  void AddEnded(TransferInfo info, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails every pending transfer matching `match` with `status`; returns the ones failed.
  std::vector<TransferInfo> FailIf(const std::function<bool(const TransferInfo&)>& match,
                                   const std::function<absl::Status(const TransferInfo&)>& status)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Fails pending transfers whose deadline has passed.
  std::vector<TransferInfo> ExpireDeadlines(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  // Sleeps until the earliest pending deadline has passed (true), `limit` passed (true), or
  // StopDeadlineWaits was called (false). A Start with an earlier deadline wakes it.
  bool WaitForDeadline(absl::Time limit) ABSL_LOCKS_EXCLUDED(mu_);
  void StopDeadlineWaits() ABSL_LOCKS_EXCLUDED(mu_);

  // The completion thread's loop: runs the end callbacks of ended transfers, one at a time, in
  // the order they ended, outside mu_. Returns after StopEndCallbacks once every queued
  // callback ran (a transfer ended before the stop is always reported).
  void RunEndCallbacks() ABSL_LOCKS_EXCLUDED(mu_);
  void StopEndCallbacks() ABSL_LOCKS_EXCLUDED(mu_);

  TransferState Poll(TransferId id, absl::Status* status) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits up to `timeout` for the transfer to end. With `poll` > 0 it first watches for ends
  // without sleeping for up to `poll` (EngineOptions::wait_poll): a transfer that ends in that
  // time costs its ender no futex wake and its waiter no sleep and reschedule. Only while the
  // core is the waiter's: wait_gate_ (src/util/spin_gate.h) stops the spin of a thread that
  // was preempted, backs off, and bounds how many waiters spin at once.
  absl::Status Wait(TransferId id, absl::Duration timeout,
                    absl::Duration poll = absl::ZeroDuration()) ABSL_LOCKS_EXCLUDED(mu_);
  size_t pending() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Record {
    TransferInfo info;
    uint32_t lanes_left = 0;
    absl::Status lane_error;
    bool ended = false;
    bool claimed = false;        // ClaimEnd was called: only CompleteEnd ends it
    bool deadline_armed = true;  // in deadlines_ (until ended or claimed)
    absl::Status final_status;
    std::shared_ptr<std::atomic<bool>> cancelled;
    EndCallback on_end;
  };
  struct PendingEnd {
    EndCallback on_end;
    TransferId id = 0;
    absl::Status status;
  };
  // Ends `record` (false when it had ended already). A record with an end callback has its
  // callback queued and must then be forgotten by the caller (ForgetLocked), outside any
  // iteration over records_.
  bool EndLocked(Record& record, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeForgetLocked(TransferId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the record at `it` (its lanes still out are kept in draining_).
  void ForgetLocked(absl::flat_hash_map<TransferId, Record>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Steady state allocates nothing per transfer: deadline set nodes and cancellation flags
  // of forgotten transfers are kept for the next ones (at most kSpares of each).
  void EraseDeadlineLocked(Record& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void InsertDeadlineLocked(absl::Time deadline, TransferId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Forget(Record& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr size_t kSpares = 64;

  SpinGate wait_gate_;  // Wait's spins
  mutable Mutex mu_;
  CondVar ended_cv_;     // Wait
  CondVar deadline_cv_;  // WaitForDeadline: an earlier deadline, or the stop
  // When the thread in WaitForDeadline wakes anyway (InfinitePast while it is awake: it
  // re-reads the deadlines before it sleeps again).
  absl::Time deadline_wake_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  CondVar ends_cv_;  // RunEndCallbacks: a callback queued, or the stop
  absl::flat_hash_map<TransferId, Record> records_ ABSL_GUARDED_BY(mu_);
  // Counts ends (EndLocked, EndInline); read without mu_ by a polling Wait.
  std::atomic<uint64_t> ends_seen_{0};
  // Deadlines of transfers that may still expire (not ended, not claimed), earliest first.
  using Deadlines = std::set<std::pair<absl::Time, TransferId>>;
  Deadlines deadlines_ ABSL_GUARDED_BY(mu_);
  std::vector<Deadlines::node_type> spare_deadlines_ ABSL_GUARDED_BY(mu_);
  // Flags no transport holds any more (use_count 1), reset to false.
  std::vector<std::shared_ptr<std::atomic<bool>>> spare_flags_ ABSL_GUARDED_BY(mu_);
  std::deque<PendingEnd> ends_ ABSL_GUARDED_BY(mu_);
  bool deadline_waits_stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool end_callbacks_stopped_ ABSL_GUARDED_BY(mu_) = false;
  // Ended and reported transfers whose lanes are still running (kept so LaneDone is a no-op).
  absl::flat_hash_map<TransferId, uint32_t> draining_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_TRANSFER_TABLE_H_
