#include "src/core/arrival_counter.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "src/util/log.h"

namespace kvwire::core {

void ArrivalCounter::MaybeDeliverLocked(const Key& key, Entry& entry) {
  if (!entry.notified || entry.arrived < entry.expected) return;
  if (ready_.size() >= limit_) {
    if (dropped_++ == 0 || dropped_ % 1024 == 0) {
      KVW_LOG(kWarning, "engine") << "notification dropped: the consumer is not taking them"
                                  << Kv("undrained", ready_.size()) << Kv("limit", limit_)
                                  << Kv("peer", entry.notification.peer_name)
                                  << Kv("transfer", entry.notification.transfer_id)
                                  << Kv("dropped_total", dropped_);
    }
  } else {
    ready_.push_back(std::move(entry.notification));
    ++delivered_;
    ready_cv_.SignalAll();
  }
  entries_.erase(key);
}

absl::Status ArrivalCounter::OnArrival(PeerId peer, TransferId transfer) {
  MutexLock lock(&mu_);
  const Key key{peer, transfer};
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    if (entries_.size() >= limit_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("data of transfer ", transfer, " arrived while ", entries_.size(),
                       " transfers wait for their data or notification (limit ", limit_, ")"));
    }
    it = entries_.try_emplace(key).first;
    it->second.first_seen = absl::Now();
  }
  ++it->second.arrived;
  MaybeDeliverLocked(key, it->second);
  return absl::OkStatus();
}

absl::Status ArrivalCounter::OnNotify(Notification notification, uint64_t expected) {
  MutexLock lock(&mu_);
  const Key key{notification.peer, notification.transfer_id};
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    if (entries_.size() >= limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "notification of transfer ", notification.transfer_id, " arrived while ", entries_.size(),
          " transfers wait for their data or notification (limit ", limit_, ")"));
    }
    it = entries_.try_emplace(key).first;
    it->second.first_seen = absl::Now();
  }
  it->second.notified = true;
  it->second.expected = expected;
  it->second.notification = std::move(notification);
  MaybeDeliverLocked(key, it->second);
  return absl::OkStatus();
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

uint64_t ArrivalCounter::dropped() const {
  MutexLock lock(&mu_);
  return dropped_;
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
