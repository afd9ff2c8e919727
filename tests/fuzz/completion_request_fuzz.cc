// The body of POST /v1/completions (examples/dsv4/serve/completion_api.cc), as an HTTP client
// sends it to the dsv4 servers and the router, and the kv_transfer_params it carries, which
// the server hands to the connector (KvTransferParams::FromJson). A body that parses must
// hold values inside the documented ranges.
#include <cstddef>
#include <cstdint>
#include <string>

#include "examples/dsv4/serve/completion_api.h"
#include "kvwire/connector.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr int kVocabSize = 258;  // the byte tokenizer's (configs/tiny.json)

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<dsv4::serve::CompletionRequest> request =
      dsv4::serve::ParseCompletionRequest(body, kVocabSize);
  if (!request.ok()) {
    KVWIRE_FUZZ_CHECK(request.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  KVWIRE_FUZZ_CHECK(request->max_tokens >= 1);
  KVWIRE_FUZZ_CHECK(request->temperature >= 0.0f && request->temperature <= 100.0f);
  KVWIRE_FUZZ_CHECK(!request->first_token ||
                    (*request->first_token >= 0 && *request->first_token < kVocabSize));
  KVWIRE_FUZZ_CHECK(request->kv_transfer_params.is_null() ||
                    request->kv_transfer_params.is_object());
  if (request->kv_transfer_params.is_object()) {
    (void)kvwire::KvTransferParams::FromJson(dsv4::serve::Dump(request->kv_transfer_params));
  }
  // The response side: echoing what the client sent must not fail on any bytes.
  (void)dsv4::serve::Dump(
      dsv4::serve::CompletionJson("cmpl-1", request->model, request->prompt, {}, "length"));
  return 0;
}
