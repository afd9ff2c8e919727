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
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "src/core/grant_table.h"
#include "src/core/in_flight_seqs.h"
#include "src/util/block_pool.h"
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
  // The same for an op that presents read grant `grant` (not 0) and moves `bytes`: counted
  // under the grant as well (in flight, then served when its pin goes). The grant's liveness
  // is checked again here, under this object's lock, which every revocation holds (Revoke,
  // RevokeWhenServed, ForgetPeer): an op is either counted before a revocation or finds the
  // grant gone after it, so "no op under the grant in flight" after a revocation means none
  // ever will be. A grant no longer live: nullptr when `required` (the region is readable
  // only under a grant: the op is refused), else the op is counted as Begin's (ungranted).
  std::shared_ptr<const void> BeginGranted(PeerId peer, GrantId grant, uint64_t bytes,
                                           bool required, const GrantTable& grants,
                                           std::shared_ptr<const void> inner)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Event, not wait: calls `done` once every op of `peer` that began before this call has
  // ended. True, without calling or keeping `done`, when none is being served now; otherwise
  // `done` runs once, on the thread that ends the last of them (it must not block, nor call
  // into the engine), or is dropped with this object.
  bool WhenPeerServed(PeerId peer, std::function<void()> done) ABSL_LOCKS_EXCLUDED(mu_);

  // Revokes `grant` of `peer` in `grants` once at least `bytes` were served under it and no op
  // under it is being served (bytes 0: at once), then calls `done` once no op under it is being
  // served any more. A grant revoked otherwise meanwhile (Revoke, ForgetPeer, another call with
  // 0) no longer waits for its bytes. True, without calling or keeping `done`, when all of it
  // holds now; else as WhenPeerServed's `done`.
  bool RevokeWhenServed(PeerId peer, GrantId grant, uint64_t bytes, GrantTable& grants,
                        std::function<void()> done) ABSL_LOCKS_EXCLUDED(mu_);
  // Revokes at once (GrantTable::Remove's status); waiters of the grant stop waiting for bytes.
  absl::Status Revoke(PeerId peer, GrantId grant, GrantTable& grants) ABSL_LOCKS_EXCLUDED(mu_);
  // Every grant of a closed peer (GrantTable::ForgetPeer), as Revoke.
  void ForgetPeer(PeerId peer, GrantTable& grants) ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes served under `grant` of `peer` so far (ops ended); 0 once it is revoked and idle.
  uint64_t ServedBytes(PeerId peer, GrantId grant) const ABSL_LOCKS_EXCLUDED(mu_);

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
  // Pins' memory kept for the next ops (the pool's free blocks).
  size_t pooled_pins() const { return pin_pool_->free_blocks(); }

 private:
  struct OpPin;
  struct GrantWatch {
    uint64_t bytes = 0;
    std::function<void()> done;
  };
  // One grant's ops: kept while it is live and had ops, or has ops or watches.
  struct GrantUse {
    uint64_t in_flight = 0;
    uint64_t served = 0;
    bool revoked = false;
    std::vector<GrantWatch> watches;
  };
  struct PeerWatch {
    PeerId peer;
    uint64_t mark;
    std::function<void()> done;
  };
  std::shared_ptr<const void> BeginLocked(PeerId peer, GrantId grant, uint64_t bytes,
                                          std::shared_ptr<const void> inner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void End(PeerId peer, uint64_t seq, GrantId grant, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the watches of `key` that hold now into `fired` (revoking the grant for the first
  // that waited for bytes), and drops the entry when nothing needs it any more.
  void SettleLocked(const GrantKey& key, GrantUse& use, std::vector<std::function<void()>>& fired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkRevokedLocked(const GrantKey& key, std::vector<std::function<void()>>& fired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // No op of `peer` numbered below `mark` is being served.
  bool ServedLocked(PeerId peer, uint64_t mark) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  CondVar ended_;
  // The pins' memory (one per op served): reused, not allocated per op. Its own lock, taken
  // under mu_ (Begin) or alone (a pin's release), never the other way round.
  std::shared_ptr<BlockPool> pin_pool_ = std::make_shared<BlockPool>(4096);
  // Engine-wide, so that a peer's entry can go when it has no op without reusing numbers.
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  size_t waiters_ ABSL_GUARDED_BY(mu_) = 0;
  // Sequence numbers of the ops of each peer being served; no entry when none is. An entry
  // that empties leaves its ring in `spare_` (a few), for the next peer entry to take: steady
  // traffic allocates nothing here.
  absl::flat_hash_map<PeerId, InFlightSeqs> live_ ABSL_GUARDED_BY(mu_);
  std::vector<InFlightSeqs> spare_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<GrantKey, GrantUse> grants_ ABSL_GUARDED_BY(mu_);
  std::vector<PeerWatch> peer_watches_ ABSL_GUARDED_BY(mu_);
  // The engine's grant table (one per engine), for revoking when a watch's bytes were served
  // (set by RevokeWhenServed, the only call that waits for bytes).
  GrantTable* grant_table_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace kvwire::core

#endif  // KVWIRE_CORE_SERVED_OPS_H_
