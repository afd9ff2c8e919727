#include "src/core/arrival_counter.h"

#include "absl/time/clock.h"

namespace kvwire::core {

void ArrivalCounter::MaybeDeliverLocked(const Key& key, Entry& entry) {
  if (!entry.notified || entry.arrived < entry.expected) return;
  ready_.push_back(std::move(entry.notification));
  ++delivered_;
  entries_.erase(key);
  ready_cv_.SignalAll();
}

void ArrivalCounter::OnArrival(PeerId peer, TransferId transfer) {
  MutexLock lock(&mu_);
  const Key key{peer, transfer};
  auto [it, inserted] = entries_.try_emplace(key);
  if (inserted) it->second.first_seen = absl::Now();
  ++it->second.arrived;
  MaybeDeliverLocked(key, it->second);
}

void ArrivalCounter::OnNotify(Notification notification, uint64_t expected) {
  MutexLock lock(&mu_);
  const Key key{notification.peer, notification.transfer_id};
  auto [it, inserted] = entries_.try_emplace(key);
  if (inserted) it->second.first_seen = absl::Now();
  it->second.notified = true;
  it->second.expected = expected;
  it->second.notification = std::move(notification);
  MaybeDeliverLocked(key, it->second);
}

size_t ArrivalCounter::DropPeer(PeerId peer) {
  MutexLock lock(&mu_);
  size_t waiting = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->first.first == peer) {
      if (it->second.notified) ++waiting;
      entries_.erase(it++);
    } else {
      ++it;
    }
  }
  return waiting;
}

size_t ArrivalCounter::Prune(absl::Time now, absl::Duration max_age) {
  MutexLock lock(&mu_);
  size_t pruned = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!it->second.notified && now - it->second.first_seen > max_age) {
      entries_.erase(it++);
      ++pruned;
    } else {
      ++it;
    }
  }
  return pruned;
}

std::vector<Notification> ArrivalCounter::TakeAll() {
  MutexLock lock(&mu_);
  std::vector<Notification> out(std::make_move_iterator(ready_.begin()),
                                std::make_move_iterator(ready_.end()));
  ready_.clear();
  return out;
}

bool ArrivalCounter::WaitOne(absl::Time deadline, Notification* out) {
  MutexLock lock(&mu_);
  while (ready_.empty()) {
    if (!ready_cv_.WaitUntil(&mu_, deadline) && ready_.empty()) return false;
  }
  *out = std::move(ready_.front());
  ready_.pop_front();
  return true;
}

uint64_t ArrivalCounter::delivered() const {
  MutexLock lock(&mu_);
  return delivered_;
}

size_t ArrivalCounter::pending_entries() const {
  MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace kvwire::core
