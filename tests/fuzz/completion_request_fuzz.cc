// The body of POST /v1/completions and /v1/chat/completions (examples/dsv4/serve/
// completion_api.cc, chat_template.cc), as an HTTP client sends it to the dsv4 servers and the
// router, and the kv_transfer_params it carries, which the server hands to the connector
// (KvTransferParams::FromJson). Each input is parsed for both endpoints. A body that parses
// must hold values inside the documented ranges (the sampling parameters' are vLLM's); its stop
// strings then run over its own prompt (stop_strings.cc), which must release no more than it was
// fed.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/stop_strings.h"
#include "kvwire/connector.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr int kVocabSize = 258;  // the byte tokenizer's (configs/tiny.json)

void Check(const std::string& body, dsv4::serve::Endpoint endpoint) {
  absl::StatusOr<dsv4::serve::CompletionRequest> request =
      dsv4::serve::ParseCompletionRequest(body, kVocabSize, endpoint);
  if (!request.ok()) {
    KVWIRE_FUZZ_CHECK(request.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  KVWIRE_FUZZ_CHECK(request->endpoint == endpoint);
  KVWIRE_FUZZ_CHECK(request->max_tokens >= 1);
  const dsv4::serve::SamplingParams& p = request->sampling;
  KVWIRE_FUZZ_CHECK(p.temperature == 0.0 ||
                    (p.temperature >= dsv4::serve::kMinSamplingTemperature &&
                     p.temperature <= dsv4::serve::kMaxTemperature));
  KVWIRE_FUZZ_CHECK(p.top_p > 0.0 && p.top_p <= 1.0);
  KVWIRE_FUZZ_CHECK(p.top_k >= 0);
  KVWIRE_FUZZ_CHECK(p.min_p >= 0.0 && p.min_p <= 1.0);
  KVWIRE_FUZZ_CHECK(p.presence_penalty >= -2.0 && p.presence_penalty <= 2.0);
  KVWIRE_FUZZ_CHECK(p.frequency_penalty >= -2.0 && p.frequency_penalty <= 2.0);
  KVWIRE_FUZZ_CHECK(p.repetition_penalty > 0.0 && std::isfinite(p.repetition_penalty));
  KVWIRE_FUZZ_CHECK(p.min_tokens >= 0 && p.min_tokens <= request->max_tokens);
  KVWIRE_FUZZ_CHECK(!p.logprobs || *p.logprobs >= -1);
  KVWIRE_FUZZ_CHECK(p.n >= 1 && p.n <= dsv4::serve::kMaxChoices && (p.n == 1 || !p.greedy()));
  KVWIRE_FUZZ_CHECK(!p.seed || *p.seed != ~uint64_t{0});  // -1: no seed
  KVWIRE_FUZZ_CHECK(!p.echo || (endpoint == dsv4::serve::Endpoint::kCompletions && !p.logprobs));
  if (request->prompt_ids) {
    KVWIRE_FUZZ_CHECK(endpoint == dsv4::serve::Endpoint::kCompletions);
    KVWIRE_FUZZ_CHECK(!request->prompt_ids->empty() && request->prompt.empty());
    for (int32_t t : *request->prompt_ids) KVWIRE_FUZZ_CHECK(t >= 0 && t < kVocabSize);
  }
  KVWIRE_FUZZ_CHECK(request->stop.size() <= dsv4::serve::kMaxStopStrings);
  for (const std::string& s : request->stop) {
    KVWIRE_FUZZ_CHECK(!s.empty() && s.size() <= dsv4::serve::kMaxStopBytes);
  }
  KVWIRE_FUZZ_CHECK(!request->include_usage || request->stream);
  KVWIRE_FUZZ_CHECK(request->kv_transfer_params.is_null() ||
                    request->kv_transfer_params.is_object());
  if (request->kv_transfer_params.is_object()) {
    for (const auto& [key, value] : request->kv_transfer_params.items()) {
      KVWIRE_FUZZ_CHECK(!value.is_null());
    }
    (void)kvwire::KvTransferParams::FromJson(dsv4::serve::Dump(request->kv_transfer_params));
  }
  // The stop strings over the prompt's bytes: what comes out is a prefix of what went in.
  dsv4::serve::StopMatcher stop(request->stop);
  std::string out;
  for (char c : request->prompt) {
    for (int32_t t : stop.Feed(static_cast<unsigned char>(c), std::string(1, c))) {
      out.push_back(static_cast<char>(t));
    }
  }
  if (!stop.stopped()) {
    for (int32_t t : stop.Flush()) out.push_back(static_cast<char>(t));
    KVWIRE_FUZZ_CHECK(out == request->prompt);
  } else {
    KVWIRE_FUZZ_CHECK(request->prompt.compare(0, out.size(), out) == 0);
  }
  // The response side: echoing what the client sent must not fail on any bytes.
  for (bool chunk : {false, true}) {
    (void)dsv4::serve::Dump(dsv4::serve::ResponseJson(
        endpoint, chunk, chunk, "cmpl-1", request->model, request->prompt, {}, "length"));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  Check(body, dsv4::serve::Endpoint::kCompletions);
  Check(body, dsv4::serve::Endpoint::kChat);
  return 0;
}
