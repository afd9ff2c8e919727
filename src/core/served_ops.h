// Target side: the ops this engine is serving for its peers (the tcp transport's serving
// thread reads or writes registered memory for each one), so that the owner of that memory
// can order its own accesses after theirs.
//
// Why: a peer's word about memory (a connector's "release" of blocks it was reading) travels
// on the control connection, the ops on data connections. The peer sends it once it has
// received every byte, but the serving thread may not yet have released the op (its last
// access to the memory is a send that the peer sees before the thread moves on), and an op
// of a peer that gave up early may still be queued. Nothing else orders "the serving thread
// read the block" before "the owner refilled it": without this, a block released by a peer
// could be refilled while the engine still reads it. WaitForPeer closes that gap, and the
// mutex makes the order a real happens-before (ThreadSanitizer sees it as such too).
#ifndef KVWIRE_CORE_SERVED_OPS_H_
#define KVWIRE_CORE_SERVED_OPS_H_

#include <cstdint>
#include <memory>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "src/util/mutex.h"

namespace kvwire::core {

// Held by shared_ptr: the pins it hands out keep it alive.
class ServedOps : public std::enable_shared_from_this<ServedOps> {
 public:
  ServedOps() = default;
  ServedOps(const ServedOps&) = delete;
  ServedOps& operator=(const ServedOps&) = delete;

  // An op of `peer` begins to be served; it ends when the returned pin (which holds `inner`,
  // the memory's own pin) is released, i.e. after the transport's last access to the memory.
  std::shared_ptr<const void> Begin(PeerId peer, std::shared_ptr<const void> inner)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until every op of `peer` that began before this call has ended. OK at once when
  // none is being served; DeadlineExceeded (naming how many remain) after `timeout`.
  absl::Status WaitForPeer(PeerId peer, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  // Orders the caller's earlier writes to registered memory before every op that begins
  // after this returns (Begin takes the same mutex): memory filled, then published, then
  // handed to a peer is seen whole by the serving thread.
  void Publish() ABSL_LOCKS_EXCLUDED(mu_);

  // Ops being served now (all peers).
  size_t in_flight() const ABSL_LOCKS_EXCLUDED(mu_);
  // Calls of WaitForPeer waiting now (each has fixed the ops it waits for).
  size_t waiters() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct OpPin;
  void End(PeerId peer, uint64_t seq) ABSL_LOCKS_EXCLUDED(mu_);
  // No op of `peer` numbered below `mark` is being served.
  bool ServedLocked(PeerId peer, uint64_t mark) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  CondVar ended_;
  // Engine-wide, so that a peer's entry can go when it has no op without reusing numbers.
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  size_t waiters_ ABSL_GUARDED_BY(mu_) = 0;
  // Sequence numbers of the ops of each peer being served; no entry when none is.
  absl::flat_hash_map<PeerId, std::set<uint64_t>> live_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_SERVED_OPS_H_
