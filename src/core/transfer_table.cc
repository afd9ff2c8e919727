#include "src/core/transfer_table.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvwire::core {

std::shared_ptr<std::atomic<bool>> TransferTable::Start(const TransferInfo& info, uint32_t lanes) {
  MutexLock lock(&mu_);
  Record record;
  record.info = info;
  record.lanes_left = lanes;
  record.cancelled = std::make_shared<std::atomic<bool>>(false);
  auto cancelled = record.cancelled;
  records_.emplace(info.id, std::move(record));
  return cancelled;
}

bool TransferTable::EndLocked(Record& record, absl::Status status) {
  if (record.ended) return false;
  record.ended = true;
  record.final_status = std::move(status);
  record.cancelled->store(true, std::memory_order_release);
  ended_cv_.SignalAll();
  return true;
}

std::optional<LanesDone> TransferTable::LaneDone(TransferId id, absl::Status status) {
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
  return LanesDone{record.info, record.lane_error};
}

bool TransferTable::Finish(TransferId id, absl::Status status) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return false;
  return EndLocked(it->second, std::move(status));
}

bool TransferTable::ClaimEnd(TransferId id) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end() || it->second.ended || it->second.claimed) return false;
  it->second.claimed = true;
  return true;
}

void TransferTable::CompleteEnd(TransferId id, absl::Status status) {
  MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it != records_.end()) EndLocked(it->second, std::move(status));
}

std::vector<TransferInfo> TransferTable::FailIf(
    const std::function<bool(const TransferInfo&)>& match,
    const std::function<absl::Status(const TransferInfo&)>& status) {
  MutexLock lock(&mu_);
  std::vector<TransferInfo> failed;
  for (auto& [id, record] : records_) {
    if (!record.ended && !record.claimed && match(record.info) &&
        EndLocked(record, status(record.info))) {
      failed.push_back(record.info);
    }
  }
  return failed;
}

std::vector<TransferInfo> TransferTable::ExpireDeadlines(absl::Time now) {
  return FailIf(
      [now](const TransferInfo& info) { return info.deadline <= now; },
      [](const TransferInfo& info) {
        return absl::DeadlineExceededError(absl::StrCat(
            "transfer ", info.id, " to peer ", info.peer, " (", info.bytes, " bytes): deadline of ",
            absl::FormatDuration(info.deadline - info.start), " exceeded"));
      });
}

void TransferTable::MaybeForgetLocked(TransferId id) {
  auto it = records_.find(id);
  if (it == records_.end()) return;
  if (it->second.lanes_left > 0) draining_[id] = it->second.lanes_left;
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
  absl::Status final_status = it->second.final_status;
  MaybeForgetLocked(id);
  const TransferState state =
      final_status.ok() ? TransferState::kSucceeded : TransferState::kFailed;
  if (status) *status = std::move(final_status);
  return state;
}

absl::Status TransferTable::Wait(TransferId id, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  MutexLock lock(&mu_);
  while (true) {
    auto it = records_.find(id);
    if (it == records_.end()) return absl::NotFoundError(absl::StrCat("unknown transfer ", id));
    if (it->second.ended) {
      absl::Status final_status = it->second.final_status;
      MaybeForgetLocked(id);
      return final_status;
    }
    if (!ended_cv_.WaitUntil(&mu_, deadline) && absl::Now() >= deadline) {
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
