#include "src/core/transfer_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvwire::core {

std::shared_ptr<std::atomic<bool>> TransferTable::Start(TransferInfo info, uint32_t lanes,
                                                        EndCallback on_end, bool arm_deadline) {
  const TransferId id = info.id;
  const absl::Time deadline = info.deadline;
  MutexLock lock(&mu_);
  Record& record = records_.try_emplace(id).first->second;  // built in place
  record.info = std::move(info);
  record.lanes_left = lanes;
  if (spare_flags_.empty()) {
    record.cancelled = std::make_shared<std::atomic<bool>>(false);
  } else {
    record.cancelled = std::move(spare_flags_.back());
    spare_flags_.pop_back();
  }
  record.on_end = std::move(on_end);
  record.deadline_armed = arm_deadline;
  auto cancelled = record.cancelled;
  if (arm_deadline) InsertDeadlineLocked(deadline, id);
  return cancelled;
}

void TransferTable::AddEnded(TransferInfo info, absl::Status status) {
  const TransferId id = info.id;
  MutexLock lock(&mu_);
  Record& record = records_.try_emplace(id).first->second;
  record.info = std::move(info);
  record.ended = true;
  record.deadline_armed = false;
  record.final_status = std::move(status);
  ends_seen_.fetch_add(1, std::memory_order_release);
}

void TransferTable::InsertDeadlineLocked(absl::Time deadline, TransferId id) {
  // The deadline thread sleeps until the earliest deadline (or its own limit): only a deadline
  // before the time it will wake anyway wakes it. (Waking it on every Start into an empty
  // table cost a thread switch per transfer: ~6 us per 64 KiB shm transfer on two cores.)
  if (spare_deadlines_.empty()) {
    deadlines_.emplace(deadline, id);
  } else {
    Deadlines::node_type node = std::move(spare_deadlines_.back());
    spare_deadlines_.pop_back();
    node.value() = {deadline, id};
    deadlines_.insert(std::move(node));
  }
  if (deadline < deadline_wake_at_) deadline_cv_.SignalAll();
}

void TransferTable::ArmDeadline(TransferId id) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return;
  Record& record = it->second;
  if (record.deadline_armed || record.ended || record.claimed) return;
  record.deadline_armed = true;
  InsertDeadlineLocked(record.info.deadline, id);
}

absl::Status TransferTable::DeadlineError(const TransferInfo& info) {
  return absl::DeadlineExceededError(absl::StrCat(
      "transfer ", info.id, " to peer ", info.peer, " (", info.bytes, " bytes): deadline of ",
      absl::FormatDuration(info.deadline - info.start), " exceeded"));
}

void TransferTable::EraseDeadlineLocked(Record& record) {
  // Not armed (Start without it, never ArmDeadline'd): nothing to look for.
  if (!record.deadline_armed) return;
  record.deadline_armed = false;
  Deadlines::node_type node = deadlines_.extract({record.info.deadline, record.info.id});
  if (!node.empty() && spare_deadlines_.size() < kSpares) {
    spare_deadlines_.push_back(std::move(node));
  }
}

void TransferTable::Forget(Record& record) {
  // Only this table holds the flag once no transport does (the lanes' requests are
  // destroyed): nobody can read it any more, so it can serve the next transfer. The fence
  // orders the transports' last reads before the reset (their release of the reference is
  // what use_count observed).
  if (record.cancelled != nullptr && record.cancelled.use_count() == 1 &&
      spare_flags_.size() < kSpares) {
    std::atomic_thread_fence(std::memory_order_acquire);
    record.cancelled->store(false, std::memory_order_relaxed);
    spare_flags_.push_back(std::move(record.cancelled));
  }
}

bool TransferTable::EndLocked(Record& record, absl::Status status) {
  if (record.ended) return false;
  record.ended = true;
  EraseDeadlineLocked(record);
  record.cancelled->store(true, std::memory_order_release);
  ends_seen_.fetch_add(1, std::memory_order_release);
  if (record.on_end) {
    ends_.push_back(PendingEnd{std::move(record.on_end), record.info.id, std::move(status)});
    ends_cv_.Signal();
  } else {
    record.final_status = std::move(status);
  }
  ended_cv_.SignalAll();
  return true;
}

std::optional<LanesDone> TransferTable::LaneDone(TransferId id, absl::Status status,
                                                 bool claim_unless_notifying) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    // Reported already (deadline, peer death); only its lane count is left.
    auto d = draining_.find(id);
    if (d != draining_.end() && --d->second == 0) draining_.erase(d);
    return std::nullopt;
  }
  Record& record = it->second;
  if (!status.ok() && record.lane_error.ok()) record.lane_error = std::move(status);
  if (record.lanes_left > 0) --record.lanes_left;
  if (record.lanes_left > 0 || record.ended) return std::nullopt;
  const bool claim = claim_unless_notifying && !record.claimed &&
                     (!record.lane_error.ok() || !record.info.notification.has_value());
  if (claim) {
    record.claimed = true;
    EraseDeadlineLocked(record);  // only CompleteEnd ends it now
  }
  return LanesDone{record.info, record.lane_error, claim};
}

bool TransferTable::Finish(TransferId id, absl::Status status) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return false;
  const bool callback = static_cast<bool>(it->second.on_end);
  if (!EndLocked(it->second, std::move(status))) return false;
  if (callback) MaybeForgetLocked(id);
  return true;
}

bool TransferTable::ClaimEnd(TransferId id) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end() || it->second.ended || it->second.claimed) return false;
  it->second.claimed = true;
  EraseDeadlineLocked(it->second);  // only CompleteEnd ends it now
  return true;
}

void TransferTable::CompleteEnd(TransferId id, absl::Status status) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return;
  const bool callback = static_cast<bool>(it->second.on_end);
  if (EndLocked(it->second, std::move(status)) && callback) MaybeForgetLocked(id);
}

bool TransferTable::EndInline(TransferId id, absl::Status* status, absl::Time now) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    // Ended and forgotten already; only its lane count is left (as in LaneDone).
    auto d = draining_.find(id);
    if (d != draining_.end() && --d->second == 0) draining_.erase(d);
    return false;
  }
  Record& record = it->second;
  if (record.lanes_left > 0) --record.lanes_left;
  if (record.ended || record.claimed) return false;
  record.ended = true;
  if (record.deadline_armed) {
    EraseDeadlineLocked(record);
  } else if (status->ok() && record.info.deadline <= now) {
    // Unwatched while it ran: ended as ExpireDeadlines would have ended it.
    *status = DeadlineError(record.info);
  }
  record.cancelled->store(true, std::memory_order_release);
  record.final_status = *status;
  // No waiter to wake: its id is not out yet (Wait, Poll and the end counter need nothing).
  return true;
}

std::vector<TransferInfo> TransferTable::FailIf(
    const std::function<bool(const TransferInfo&)>& match,
    const std::function<absl::Status(const TransferInfo&)>& status) {
  MutexLock lock(&mu_);
  std::vector<TransferInfo> failed;
  std::vector<TransferId> reported;  // to their callbacks: forgotten after the loop
  for (auto& [id, record] : records_) {
    if (record.ended || record.claimed || !match(record.info)) continue;
    const bool callback = static_cast<bool>(record.on_end);
    if (EndLocked(record, status(record.info))) {
      failed.push_back(record.info);
      if (callback) reported.push_back(id);
    }
  }
  for (TransferId id : reported) MaybeForgetLocked(id);
  return failed;
}

std::vector<TransferInfo> TransferTable::ExpireDeadlines(absl::Time now) {
  MutexLock lock(&mu_);
  std::vector<TransferId> expired;
  for (auto d = deadlines_.begin(); d != deadlines_.end() && d->first <= now; ++d) {
    expired.push_back(d->second);
  }
  std::vector<TransferInfo> failed;
  for (TransferId id : expired) {
    auto it = records_.find(id);
    if (it == records_.end()) continue;
    Record& record = it->second;
    const TransferInfo& info = record.info;
    const bool callback = static_cast<bool>(record.on_end);
    absl::Status status = DeadlineError(info);
    if (!EndLocked(record, std::move(status))) continue;
    failed.push_back(info);
    if (callback) MaybeForgetLocked(id);
  }
  return failed;
}

bool TransferTable::WaitForDeadline(absl::Time limit) {
  MutexLock lock(&mu_);
  while (!deadline_waits_stopped_) {
    const absl::Time next = deadlines_.empty() ? limit : std::min(limit, deadlines_.begin()->first);
    if (absl::Now() >= next) {
      deadline_wake_at_ = absl::InfinitePast();  // awake: Start need not signal
      return true;
    }
    deadline_wake_at_ = next;
    deadline_cv_.WaitUntil(&mu_, next);
  }
  deadline_wake_at_ = absl::InfinitePast();
  return false;
}

void TransferTable::StopDeadlineWaits() {
  MutexLock lock(&mu_);
  deadline_waits_stopped_ = true;
  deadline_cv_.SignalAll();
}

void TransferTable::RunEndCallbacks() {
  while (true) {
    std::deque<PendingEnd> batch;
    {
      MutexLock lock(&mu_);
      while (ends_.empty() && !end_callbacks_stopped_) {
        // Idle: woken by the next end; the deadline only keeps the wait bounded.
        ends_cv_.WaitUntil(&mu_, absl::Now() + absl::Seconds(1));
      }
      if (ends_.empty()) return;  // stopped, and everything reported
      batch.swap(ends_);
    }
    for (PendingEnd& end : batch) end.on_end(end.id, end.status);
  }
}

void TransferTable::StopEndCallbacks() {
  MutexLock lock(&mu_);
  end_callbacks_stopped_ = true;
  ends_cv_.SignalAll();
}

void TransferTable::MaybeForgetLocked(TransferId id) {
  auto it = records_.find(id);
  if (it != records_.end()) ForgetLocked(it);
}

void TransferTable::ForgetLocked(absl::flat_hash_map<TransferId, Record>::iterator it) {
  if (it->second.lanes_left > 0) draining_[it->first] = it->second.lanes_left;
  Forget(it->second);
  records_.erase(it);
}

TransferState TransferTable::Poll(TransferId id, absl::Status* status) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    if (status) *status = absl::NotFoundError(absl::StrCat("unknown transfer ", id));
    return TransferState::kFailed;
  }
  if (!it->second.ended) return TransferState::kPending;
  absl::Status final_status = std::move(it->second.final_status);
  ForgetLocked(it);
  const TransferState state =
      final_status.ok() ? TransferState::kSucceeded : TransferState::kFailed;
  if (status) *status = std::move(final_status);
  return state;
}

absl::Status TransferTable::Wait(TransferId id, absl::Duration timeout, absl::Duration poll) {
  // The clock is read only when the transfer has not ended yet (a shm transfer has usually
  // ended by the time its caller waits).
  std::optional<absl::Time> deadline;
  // The spin before sleeping (wait_gate_ decides whether this thread may) and when it ends,
  // on the gate's clock; poll_until 0: no more spinning.
  SpinGate::Spin spin;
  int64_t poll_until = 0;
  mu_.Lock();
  while (true) {
    auto it = records_.find(id);
    if (it == records_.end()) {
      mu_.Unlock();
      return absl::NotFoundError(absl::StrCat("unknown transfer ", id));
    }
    if (it->second.ended) {
      absl::Status final_status = std::move(it->second.final_status);
      ForgetLocked(it);
      mu_.Unlock();
      if (spin) spin.Paid();
      return final_status;
    }
    if (!deadline.has_value()) {
      const absl::Time now = absl::Now();
      deadline = now + timeout;
      if (poll > absl::ZeroDuration()) {
        spin = wait_gate_.Begin();
        if (spin) poll_until = wait_gate_.Now() + absl::ToInt64Nanoseconds(std::min(poll, timeout));
      }
    }
    if (poll_until != 0) {
      // Watch the end counter outside the lock until some transfer ends (then look again),
      // the poll time is spent or the thread loses its core (then sleep as usual).
      const uint64_t seen = ends_seen_.load(std::memory_order_acquire);
      mu_.Unlock();
      bool ended = false;
      for (uint32_t spins = 0;; ++spins) {
        if (ends_seen_.load(std::memory_order_acquire) != seen) {
          ended = true;
          break;
        }
        // The clocks are read every 64 looks: a look costs a few ns, the clocks ~20 and (the
        // thread's CPU time, a system call) a few hundred.
        if (spins % 64 == 63) {
          const int64_t now = wait_gate_.Now();
          if (now >= poll_until || !spin.StillOurs(now)) break;
        }
        CpuRelax();
      }
      mu_.Lock();
      if (!ended) {
        poll_until = 0;
        spin.End();
      }
      continue;
    }
    if (!ended_cv_.WaitUntil(&mu_, *deadline) && absl::Now() >= *deadline) {
      mu_.Unlock();
      return absl::DeadlineExceededError(absl::StrCat("wait for transfer ", id, " timed out after ",
                                                      absl::FormatDuration(timeout),
                                                      " (the transfer is still pending)"));
    }
  }
}

size_t TransferTable::pending() const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [id, record] : records_) n += record.ended ? 0 : 1;
  return n;
}

}  // namespace kvwire::core
