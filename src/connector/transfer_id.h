// The transfer ids a prefill hands off: the capability a reader presents (read_start,
// release), so they must be unguessable. One generator for the connector's scheduler half
// and for SchedulerHalf (vLLM's scheduler process).
#ifndef KVWIRE_SRC_CONNECTOR_TRANSFER_ID_H_
#define KVWIRE_SRC_CONNECTOR_TRANSFER_ID_H_

#include <string>

#include "absl/status/statusor.h"

namespace kvwire::connector_internal {

// 128 bits from the CSPRNG, hex; an error (never a weaker id) when it fails.
absl::StatusOr<std::string> RandomTransferId();

}  // namespace kvwire::connector_internal

#endif  // KVWIRE_SRC_CONNECTOR_TRANSFER_ID_H_
