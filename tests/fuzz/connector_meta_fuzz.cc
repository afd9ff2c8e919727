// Connector metadata JSON (src/connector/worker_side.cc BindConnectorMeta): the scheduler
// half hands it to the worker half, possibly in another process, so the worker parses it as
// untrusted: load entries carry a request's kv_transfer_params and block table. The input is
// bound on a live connector; nothing is started (StartLoadKv would dial the named hosts).
#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/connector_fixture.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvwire::Connector& connector = *kvwire::fuzz::Victim().connector;
  const std::string meta(reinterpret_cast<const char*>(data), size);
  const absl::Status bound = connector.BindConnectorMeta(meta);
  // Refused inputs: malformed (InvalidArgument), or naming a request or transfer id that is
  // still live from an earlier input (AlreadyExists: duplicate ids are refused, never merged).
  KVWIRE_FUZZ_CHECK(bound.ok() || bound.code() == absl::StatusCode::kInvalidArgument ||
                    bound.code() == absl::StatusCode::kAlreadyExists);
  // Unbind. Requests the metadata created stay pending until their 2 s deadline fails them;
  // GetFinished drains those reports so that nothing grows without bound.
  KVWIRE_FUZZ_CHECK(connector.BindConnectorMeta(R"({"loads":[],"saves":[]})").ok());
  (void)connector.GetFinished();
  return 0;
}
