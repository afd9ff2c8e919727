// Messages on the shm transport's Unix socket. Each is one SOCK_SEQPACKET datagram (the
// socket keeps message boundaries, so there is no framing); a successful fetch reply carries
// the region's memfd as SCM_RIGHTS ancillary data, a Hello reply the target's epoch table. A
// copy request asks the target to move bytes itself (served copies: served_copy.h). Both ends
// run on one host, so integers are in host byte order.
#ifndef KVWIRE_TRANSPORT_SHM_FD_PROTOCOL_H_
#define KVWIRE_TRANSPORT_SHM_FD_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "kvwire/engine.h"
#include "transport/transport.h"

namespace kvwire::transport::shm {

// Upper bound of one message; longer datagrams are a protocol error.
inline constexpr size_t kMaxFdMessageBytes = 8192;
inline constexpr size_t kMaxTokenBytes = 4096;
// Ops in one copy request: with the longest token the request still fits one message.
inline constexpr size_t kMaxCopyOps = 160;

enum class FdRequestKind : uint8_t {
  kHello = 1,    // checks the token (Connect fails early on a wrong one)
  kFetch = 2,    // asks for one region's memfd
  kStaging = 3,  // asks for the connection's staging memfd (served copies)
  kCopy = 4,     // asks the target to copy between its regions and a staging slot
};

// One op of a copy request: `length` bytes at `offset` of the target's region `region`. The
// ops' bytes lie one after another in the request's staging slot, in order.
// The engine resolves a request's ops as one run (TargetHooks::ResolveIncomingRun).
using CopyOp = IncomingOp;

struct FdRequest {
  FdRequestKind kind = FdRequestKind::kHello;
  // Fetch: the region. Copy: a sequence number the reply echoes.
  RegionId region = 0;
  std::string token;
  // Copy: READ (the target copies from its regions into the slot) or WRITE (from the slot
  // into its regions), the read grant presented, the staging slot, and the ops (1 to
  // kMaxCopyOps).
  OpKind copy_kind = OpKind::kRead;
  GrantId grant = 0;
  uint32_t slot = 0;
  std::vector<CopyOp> ops;
};

struct FdReply {
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string message;  // why, when code != kOk
  RegionId region = 0;
  uint64_t memfd_offset = 0;  // where the region starts in the attached memfd
  // Fetch: the region's length. Staging: the bytes of one slot. Copy: the ops done (all of
  // them on success; on an error, the index of the op that failed).
  uint64_t length = 0;
  uint32_t access = 0;  // what the target allows; the attached fd is read-only without write
  // Fetch: the word of the target's epoch table that changes when the target moves this
  // memfd's buffer (revocation, shareable_registry.h), and its value for the attached memfd.
  // A Hello reply carries the epoch table itself (read-only, sealed).
  uint32_t epoch_slot = 0;
  uint64_t epoch = 0;
  // Staging: the number of slots. Copy: kCopyRegionMoving (served_copy.h) or 0. Fetch:
  // kFetchServedCopies or 0.
  uint32_t flags = 0;
};

// Fetch reply flag: the region is never mapped by peers (no descriptor comes with the reply):
// a device pinned its pages (an rdma MR), so the owner could not move them onto a fresh memfd
// to revoke a peer's mapping. The peer reaches it through served copies (served_copy.h), as a
// grant-guarded region.
inline constexpr uint32_t kFetchServedCopies = 1;

std::string EncodeRequest(const FdRequest& request);
absl::StatusOr<FdRequest> DecodeRequest(absl::string_view bytes);
std::string EncodeReply(const FdReply& reply);
absl::StatusOr<FdReply> DecodeReply(absl::string_view bytes);

// The same, into storage the caller keeps from one message to the next (the served-copy path
// sends one request and one reply per piece: no allocation once `out` has grown). On an error
// `*out` holds whatever was decoded so far.
void EncodeRequestTo(const FdRequest& request, std::string* out);
absl::Status DecodeRequestInto(absl::string_view bytes, FdRequest* out);
void EncodeReplyTo(const FdReply& reply, std::string* out);

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_FD_PROTOCOL_H_
