// Test-only fault injection, compiled into the library and off unless a test arms it: the
// transports call MaybeFlipPayloadByte where an op's bytes have just arrived ("in flight":
// after the network or the copy, before anything checks them), so that tests can show what
// EngineOptions::verify_checksums catches and what lands silently without it. Unarmed, the
// cost is one relaxed atomic load per payload.
#ifndef KVWIRE_UTIL_FAULT_INJECTION_H_
#define KVWIRE_UTIL_FAULT_INJECTION_H_

#include <cstddef>
#include <cstdint>

namespace kvwire::fault_injection {

enum class Site : int { kTcp = 0, kShm = 1, kRdma = 2 };
inline constexpr int kSites = 3;

// The next `count` payloads that arrive through `site` (any op, any engine of this process)
// get one byte flipped (the middle one, xor 0x20). 0 disarms.
void ArmPayloadFlips(Site site, int count);
// Flips armed but not used yet.
int PayloadFlipsLeft(Site site);

// Called by the transports: flips one byte of `data` (`length` > 0) if `site` is armed.
// Returns whether it did.
bool MaybeFlipPayloadByte(Site site, void* data, uint64_t length);

// rdma QPs forced into the error state, as a QP that broke at a peer would be (a local
// protection error, a driver reset). kTarget: the next `count` target QPs that receive a
// counted WRITE's immediate (any engine of this process) are moved to IBV_QPS_ERR right after
// it, so the initiator's next ops on them go unanswered until its retries run out.
// kInitiator: the next `count` initiator QPs about to post are moved to IBV_QPS_ERR first, so
// their work requests flush. 0 disarms.
enum class QpEnd : int { kInitiator = 0, kTarget = 1 };
void ArmQpErrors(QpEnd end, int count);
int QpErrorsLeft(QpEnd end);
// Called by the rdma transport: takes one armed error of `end`; true if the caller must
// move its QP to the error state.
bool TakeQpError(QpEnd end);

}  // namespace kvwire::fault_injection

#endif  // KVWIRE_UTIL_FAULT_INJECTION_H_
