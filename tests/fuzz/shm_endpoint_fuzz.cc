// The shm transport's endpoint string (transport/shm/shm_endpoint.cc), which a peer sends in
// its control-channel Hello and the local side parses before it dials the peer's fd socket
// and probes its memory. Whatever parses must encode and parse back to the same endpoint.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_util.h"
#include "transport/shm/shm_endpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::transport::shm;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ShmEndpoint> endpoint = ParseEndpoint(text);
  if (!endpoint.ok()) {
    KVWIRE_FUZZ_CHECK(endpoint.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  KVWIRE_FUZZ_CHECK(endpoint->pid > 0 && !endpoint->socket_name.empty());
  absl::StatusOr<ShmEndpoint> again = ParseEndpoint(EncodeEndpoint(*endpoint));
  KVWIRE_FUZZ_CHECK(again.ok());
  KVWIRE_FUZZ_CHECK(again->host_id == endpoint->host_id &&
                    again->socket_name == endpoint->socket_name && again->pid == endpoint->pid &&
                    again->probe_address == endpoint->probe_address &&
                    again->probe_value == endpoint->probe_value);
  return 0;
}
