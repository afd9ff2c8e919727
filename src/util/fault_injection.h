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

}  // namespace kvwire::fault_injection

#endif  // KVWIRE_UTIL_FAULT_INJECTION_H_
