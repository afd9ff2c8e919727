// What wakes the connector's progress thread. Completion is pushed, not polled: the engine's
// completion thread reports each transfer's end here (TransferOptions::on_complete), the
// inbox reports each message or peer close (InboxOptions::on_event), and the API calls that
// change a request report that; the thread sleeps on this one condition until one of them
// happens or its next deadline (request, lease, hello) falls due.
//
// Lock order: its mutex is a leaf. It is taken under the connector's state lock
// (Connector::Impl::mu_) and from engine threads that hold engine locks (the inbox's
// on_event runs under the engine's message lock), and nothing is called while it is held.
#ifndef KVWIRE_CONNECTOR_PROGRESS_SIGNAL_H_
#define KVWIRE_CONNECTOR_PROGRESS_SIGNAL_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "src/util/mutex.h"

namespace kvwire::connector_internal {

class ProgressSignal {
 public:
  struct EndedTransfer {
    TransferId id = 0;
    absl::Status status;
  };
  // What a wait saw: the transfers that ended since the last one, and why it returned.
  struct Wakeup {
    std::vector<EndedTransfer> ended;
    bool signalled = false;  // false: `until` passed with nothing reported
  };
  struct Counters {
    uint64_t transfer_ends = 0;  // pushed by the engine
    uint64_t notifies = 0;       // inbox events and state changes
    uint64_t signalled_wakeups = 0;
    uint64_t timed_wakeups = 0;  // woke because a deadline fell due
  };

  // A transfer ended (the engine's completion thread).
  void TransferEnded(TransferId id, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // What a served-ops watch waited for holds (Engine::RevokeWhenServed, WhenServedOps): seen
  // as an end, OK, under `ticket`, and not counted as a transfer's.
  void Served(TransferId ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // Something else changed: an inbox event, a request's state or deadline, the stop.
  void Notify() ABSL_LOCKS_EXCLUDED(mu_);
  // Sleeps until something is reported or `until` passes (at once when something already
  // was), then takes what was reported.
  // `spare` (the last wakeup's `ended`, say) becomes the queue the next ends go into, so that
  // a loop that hands it back allocates nothing per end at steady state.
  Wakeup Wait(absl::Time until, std::vector<EndedTransfer> spare = {}) ABSL_LOCKS_EXCLUDED(mu_);
  Counters counters() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  CondVar cv_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<EndedTransfer> ended_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::connector_internal

#endif  // KVWIRE_CONNECTOR_PROGRESS_SIGNAL_H_
