// Target-side notification gating: counts WRITE pieces arriving per (peer, transfer id) and
// holds a transfer's notification until its expected count has arrived, whatever connection
// or queue pair each piece used and in whatever order the notification and pieces come.
#ifndef KVWIRE_CORE_ARRIVAL_COUNTER_H_
#define KVWIRE_CORE_ARRIVAL_COUNTER_H_

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "src/util/mutex.h"

namespace kvwire::core {

class ArrivalCounter {
 public:
  // `limit` bounds both the notifications delivered but not taken, and the (peer, transfer)
  // entries still counting arrivals or waiting for them.
  explicit ArrivalCounter(uint64_t limit = UINT64_MAX) : limit_(limit) {}

  // One data piece of (peer, transfer) became visible. ResourceExhausted (nothing recorded)
  // when it would open an entry past the limit: the peer has too many transfers unfinished.
  absl::Status OnArrival(PeerId peer, TransferId transfer) ABSL_LOCKS_EXCLUDED(mu_);
  // The notification of (peer, transfer); delivered once `expected` pieces have arrived.
  // ResourceExhausted (dropped) as OnArrival. A notification complete while `limit`
  // delivered ones wait to be taken is dropped and counted (dropped()): the consumer is not
  // taking them, and the engine must not grow for it.
  absl::Status OnNotify(Notification notification, uint64_t expected) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets everything of a peer (it died or was dropped); returns how many notifications
  // were still waiting for data.
  size_t DropPeer(PeerId peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets counts with no notification older than `max_age` (their transfer failed on the
  // initiator, so its notification will never come).
  size_t Prune(absl::Time now, absl::Duration max_age) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<Notification> TakeAll() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until one notification is ready or `deadline`.
  bool WaitOne(absl::Time deadline, Notification* out) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t delivered() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t dropped() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t pending_entries() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    uint64_t arrived = 0;
    bool notified = false;
    uint64_t expected = 0;
    Notification notification;
    absl::Time first_seen;
  };
  using Key = std::pair<PeerId, TransferId>;

  void MaybeDeliverLocked(const Key& key, Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t limit_;
  mutable Mutex mu_;
  CondVar ready_cv_;
  absl::flat_hash_map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::deque<Notification> ready_ ABSL_GUARDED_BY(mu_);
  uint64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_ARRIVAL_COUNTER_H_
