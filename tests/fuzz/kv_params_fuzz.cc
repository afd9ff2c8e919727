// kv_transfer_params (src/connector/kv_params.cc): JSON that reaches the connector from an
// HTTP client (through the router and the serving engine) and from a peer's connector
// metadata. Whatever parses must survive ToJson/FromJson unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvwire/connector.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvwire::KvTransferParams> params = kvwire::KvTransferParams::FromJson(text);
  if (!params.ok()) {
    KVWIRE_FUZZ_CHECK(params.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  KVWIRE_FUZZ_CHECK(params->port >= 0 && params->port <= 65535);
  absl::StatusOr<kvwire::KvTransferParams> again =
      kvwire::KvTransferParams::FromJson(params->ToJson());
  KVWIRE_FUZZ_CHECK(again.ok());
  KVWIRE_FUZZ_CHECK(again->ToJson() == params->ToJson());
  (void)kvwire::NegotiateKvMode(kvwire::KvMode::kAuto, params->mode);
  (void)kvwire::NegotiateKvMode(kvwire::KvMode::kRead, params->mode);
  return 0;
}
