#include "src/connector/progress_signal.h"

#include "absl/time/clock.h"

namespace kvwire::connector_internal {

void ProgressSignal::TransferEnded(TransferId id, absl::Status status) {
  MutexLock lock(&mu_);
  ended_.push_back({id, std::move(status)});
  ++counters_.transfer_ends;
  cv_.Signal();
}

void ProgressSignal::Served(TransferId ticket) {
  MutexLock lock(&mu_);
  ended_.push_back({ticket, absl::OkStatus()});
  ++counters_.notifies;
  cv_.Signal();
}

void ProgressSignal::Notify() {
  MutexLock lock(&mu_);
  notified_ = true;
  ++counters_.notifies;
  cv_.Signal();
}

ProgressSignal::Wakeup ProgressSignal::Wait(absl::Time until, std::vector<EndedTransfer> spare) {
  spare.clear();
  MutexLock lock(&mu_);
  while (!notified_ && ended_.empty()) {
    if (!cv_.WaitUntil(&mu_, until) && absl::Now() >= until) break;
  }
  Wakeup w;
  w.signalled = notified_ || !ended_.empty();
  ++(w.signalled ? counters_.signalled_wakeups : counters_.timed_wakeups);
  w.ended.swap(ended_);
  ended_.swap(spare);
  notified_ = false;
  return w;
}

ProgressSignal::Counters ProgressSignal::counters() const {
  MutexLock lock(&mu_);
  return counters_;
}

}  // namespace kvwire::connector_internal
