// What a peer needs to reach an shm transport, serialized into Transport::Endpoint():
//   "kvwire-shm/1 host=<id> socket=<name> pid=<pid> probe=<hex address> nonce=<hex value>
//    cma=<0|1>"
// Values are percent-escaped, so host ids and socket names may hold any byte.
#ifndef KVWIRE_TRANSPORT_SHM_SHM_ENDPOINT_H_
#define KVWIRE_TRANSPORT_SHM_SHM_ENDPOINT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvwire::transport::shm {

struct ShmEndpoint {
  std::string host_id;
  std::string socket_name;  // in the abstract namespace (no leading NUL here)
  uint32_t pid = 0;
  // A word in the owner's memory holding `probe_value`: a peer reads it once with
  // process_vm_readv to learn whether cross-memory attach works, and that `pid` names the
  // owner in the peer's pid namespace (a different process would not hold the value).
  uint64_t probe_address = 0;
  uint64_t probe_value = 0;
  // The owner lets peers use cross-memory attach on it (ShmTransportOptions::allow_cma).
  // Absent (an older peer): not offered.
  bool cma = false;
};

std::string EncodeEndpoint(const ShmEndpoint& endpoint);
// InvalidArgument naming the problem when `text` is not an endpoint of this format.
absl::StatusOr<ShmEndpoint> ParseEndpoint(absl::string_view text);

}  // namespace kvwire::transport::shm

#endif  // KVWIRE_TRANSPORT_SHM_SHM_ENDPOINT_H_
