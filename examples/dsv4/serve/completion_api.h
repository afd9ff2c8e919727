// The OpenAI-compatible subset of POST /v1/completions the dsv4 servers accept, with the
// disaggregation fields: `kv_transfer_params` (as vLLM's P/D connectors carry it) and, for a
// decode server continuing a remote prefill, `first_token` (the token prefill sampled).
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_COMPLETION_API_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_COMPLETION_API_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

#include "src/util/json_fields.h"

namespace dsv4::serve {

// The kv_transfer_params fields the dsv4 servers act on, type-checked when the request is
// parsed (the worker thread never reads client JSON). The connector parses the whole object
// again (engine_id, block_ids, tp_sources) and reports its own errors.
struct KvTransferFields {
  bool do_remote_decode = false;
  bool do_remote_prefill = false;
  std::string mode;  // "" (unset), "auto", "read" or "write"
  std::string transfer_id;
  std::string remote_host;
  int remote_port = 0;
  uint64_t num_tokens = 0;  // 0: unset
};

// Longest transfer id, engine id or host name accepted from a client.
inline constexpr size_t kMaxIdBytes = 256;

struct CompletionRequest {
  std::string prompt;
  int max_tokens = 16;
  float temperature = 0.0f;
  uint64_t seed = 0;
  bool stream = false;
  std::string model;
  nlohmann::json kv_transfer_params;  // null or an object
  KvTransferFields kv;                // its fields, read with their types checked
  std::optional<int32_t> first_token;
  // Decode: the prefill server's timing (the router passes it through to the client).
  nlohmann::json prefill_stats;
  std::optional<int64_t> prefill_computed_unix_us;  // prefill_stats.computed_unix_us
};

// Bounds of a JSON body the dsv4 servers read (a client's request, an upstream's answer). A
// 4 MiB body of brackets would otherwise nest a million levels deep, and one of "0," hold two
// million values; bodies are copied and printed recursively.
inline constexpr kvwire::JsonLimits kHttpJsonLimits = {.max_depth = 32, .max_values = 100000};

// Validates a request body; errors name the field and what is wrong (for a 400). The body
// is parsed within kHttpJsonLimits.
absl::StatusOr<CompletionRequest> ParseCompletionRequest(const std::string& body, int vocab_size);
// The same, for a body already parsed (with kvwire::ParseJsonObject and kHttpJsonLimits).
absl::StatusOr<CompletionRequest> CompletionRequestFromJson(const nlohmann::json& body,
                                                            int vocab_size);

// Serialises JSON with invalid UTF-8 (byte tokens may split a character) replaced.
std::string Dump(const nlohmann::json& j);

// A completion (non-streamed) or one stream chunk: `text` is the detokenised `tokens`.
nlohmann::json CompletionJson(const std::string& id, const std::string& model,
                              const std::string& text, const std::vector<int32_t>& tokens,
                              const char* finish_reason);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_COMPLETION_API_H_
