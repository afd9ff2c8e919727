// The READ ops of one tcp data connection that are already buffered behind the one being
// accepted, resolved by the engine as one run (TargetHooks::ResolveIncomingRun): one trip
// through each of its locks and one served-ops record for up to kMaxRunOps ops, instead of
// one per op (a dsv4-pro request is ~3,000 READs of one page each). The ops of the run are
// then accepted one by one as before (their headers decoded and checked again, in order);
// each takes the run's pin, so the run counts as served once the last response holding it
// is sent. A run holds only while TargetHooks::AccessEpoch has not changed since it was
// checked: once a grant is revoked or a region unexported, deregistered or about to move,
// the ops not accepted yet are checked again, so that no op is accepted on an access that
// was taken back before it. An op the run does not cover (not buffered then, or not what the
// run resolved) is resolved alone, as before runs; the op that stopped the run gets the
// refusal the run found (counted once), after the ops before it. Ops resolved and never
// accepted (the connection ended first) count as served when the run is dropped.
#ifndef KVWIRE_TRANSPORT_TCP_TCP_READ_RUN_H_
#define KVWIRE_TRANSPORT_TCP_TCP_READ_RUN_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "transport/tcp/tcp_wire.h"
#include "transport/transport.h"

namespace kvwire::transport {

class ReadRun {
 public:
  static constexpr size_t kMaxRunOps = tcp_wire::kMaxFollow;

  // The access of READ `h` (decoded and in sequence), from the run when it covers `h`, else
  // from a new run of `h` and the READ headers in `ahead` (received after it, not consumed)
  // that follow it in sequence under the same grant.
  absl::StatusOr<IncomingAccess> Resolve(TargetHooks& hooks, PeerId peer,
                                         const tcp_wire::RequestHeader& h,
                                         absl::Span<const std::byte> ahead, uint64_t max_op_bytes);
  // Drops the run (its pin: ops resolved and not accepted count as served).
  void Clear();

 private:
  // The run covers `h` as op next_ (same sequence, grant and range), with the access epoch
  // unchanged.
  bool Covers(TargetHooks& hooks, const tcp_wire::RequestHeader& h) const;

  std::shared_ptr<const void> pin_;  // the resolved ops' pin (null once the last is taken)
  size_t next_ = 0;                  // the op of the run the next header must be
  size_t end_ = 0;                   // ops [next_, end_) resolved, not accepted yet
  // Why op end_ was refused (OK: not refused, or not in the run).
  absl::Status refused_;
  uint64_t next_sequence_ = 0;
  GrantId grant_ = 0;
  uint64_t epoch_ = 0;
  std::array<IncomingOp, kMaxRunOps> ops_;
  std::array<IncomingMemory, kMaxRunOps> memory_;
};

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_TCP_TCP_READ_RUN_H_
