// Served copies: the target of a shm channel moves the bytes of ops on its grant-guarded
// regions itself. A mapping would hand the initiator the whole region (docs/SECURITY.md), so
// such a region is never mapped; instead each connection that asks gets a small staging memfd
// of its own (FdRequestKind::kStaging), mapped by both processes. The initiator names the ops
// and a slot of it (FdRequestKind::kCopy); the target checks each op as it checks every op it
// serves (TargetHooks::ResolveIncoming, with the read grant) and copies between its region and
// the slot; the initiator copies between the slot and its own memory. Two memcpys, pipelined
// over the slots, instead of a loopback tcp stream; the peer sees only the bytes copied for
// it, and no ptrace access is needed either way.
#ifndef KVWIRE_TRANSPORT_SHM_SERVED_COPY_H_
#define KVWIRE_TRANSPORT_SHM_SERVED_COPY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "transport/shm/fd_protocol.h"
#include "transport/shm/mapping.h"
#include "transport/shm/unique_fd.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

// A connection's staging memfd: kCopySlots slots of kCopySlotBytes (4 MiB, mapped by both
// processes while the connection lasts). Several, so that the target fills some while the
// initiator empties others; their size bounds how long one request holds the fd server's
// thread, which serves every peer (a memcpy of 1 MiB). 4 x 1 MiB moved a dsv4-pro request
// faster than 2 x 2 MiB or 4 x 2 MiB on a 2-core VM (kvwire-request-bench).
inline constexpr uint32_t kCopySlots = 4;
inline constexpr uint64_t kCopySlotBytes = uint64_t{1} << 20;

// FdReply::flags of a copy reply: the op at `length` is on a region being moved (shm
// revocation); the ops before it are done, the rest is to be asked again after the move.
inline constexpr uint32_t kCopyRegionMoving = 1;

// What served copies moved, per transport (its stats, group "shm"): as the side that asks
// (requests sent, the bytes they named) and as the side that copies (requests answered and
// their bytes, requests refused: the peer dropped).
struct ServedCopyCounters {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> answered{0};
  std::atomic<uint64_t> answered_bytes{0};
  std::atomic<uint64_t> refused{0};
};

class CopyStaging {
 public:
  // A sealed memfd (it cannot shrink under either mapping) of kCopySlots * kCopySlotBytes,
  // mapped read-write here.
  static absl::StatusOr<std::unique_ptr<CopyStaging>> Create();
  CopyStaging(UniqueFd fd, Mapping mapping) : fd_(std::move(fd)), mapping_(std::move(mapping)) {}
  int fd() const { return fd_.get(); }
  std::byte* slot(uint32_t index) const { return mapping_.data() + index * kCopySlotBytes; }

 private:
  UniqueFd fd_;
  Mapping mapping_;
};

// Serves one copy request of `peer` through `staging` (its connection's). The reply echoes
// the request's sequence number. Its ops are checked as one run (TargetHooks::
// ResolveIncomingRun), every op included: a zero-length op is refused as tcp's target refuses
// one (no initiator of this library sends one). An op the engine refuses (not exported, out of
// bounds, no live grant) fails the request, and `*refused` is set to why: the caller drops the
// peer, as tcp does for every refused op.
FdReply ServeCopy(TargetHooks& hooks, PeerId peer, const CopyStaging& staging,
                  const FdRequest& request, absl::Status* refused);

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_SERVED_COPY_H_
