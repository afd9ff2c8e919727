// The engine's answer to an op on a region whose memory a transport is moving (shm revocation,
// TargetHooks::QuiesceRange): Unavailable with this payload. Not a refusal: the op is to be
// tried again once the move ends (tcp's target parks it; the engine's own Transfer waits).
#ifndef KVWIRE_TRANSPORT_REGION_MOVING_H_
#define KVWIRE_TRANSPORT_REGION_MOVING_H_

#include "absl/status/status.h"

namespace kvwire::transport {

inline constexpr char kRegionMovingPayload[] = "kvwire.dev/region-moving";

inline bool IsRegionMoving(const absl::Status& status) {
  return absl::IsUnavailable(status) && status.GetPayload(kRegionMovingPayload).has_value();
}

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_REGION_MOVING_H_
