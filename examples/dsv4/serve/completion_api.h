// The OpenAI-compatible subset of POST /v1/completions and POST /v1/chat/completions the dsv4
// servers accept, with vLLM's disaggregation field `kv_transfer_params` (as its P/D proxies
// send it: the prompt to prefill with do_remote_decode and max_tokens 1, then the original
// request with prefill's answer to decode). Parameters the servers cannot honour are refused
// by name (a 400), never ignored; a parameter given as null counts as not given (vLLM's proxies
// send `"min_tokens": null`).
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_COMPLETION_API_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_COMPLETION_API_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

#include "examples/dsv4/serve/sampling_params.h"
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
// Stop strings: at most this many, each at most kMaxStopBytes bytes.
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopBytes = 256;
// Longest token-id prompt (the longest model context is far below).
inline constexpr size_t kMaxPromptTokens = 1 << 20;

enum class Endpoint { kCompletions, kChat };

// "/v1/completions" or "/v1/chat/completions".
const char* EndpointPath(Endpoint e);

struct CompletionRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  // The prompt as text (the chat template's output for chat), or as token ids (then `prompt`
  // is empty and the ids are run as given: no BOS is added).
  std::string prompt;
  std::optional<std::vector<int32_t>> prompt_ids;
  int max_tokens = 16;  // chat: max_completion_tokens when given (vLLM)
  SamplingParams sampling;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  std::vector<std::string> stop;
  std::string model;
  nlohmann::json kv_transfer_params;  // null or an object (null fields dropped)
  KvTransferFields kv;                // its fields, read with their types checked
  // Decode: the prefill server's timing (the router passes it through to the client).
  nlohmann::json prefill_stats;
  std::optional<int64_t> prefill_computed_unix_us;  // prefill_stats.computed_unix_us
};

// Bounds of a JSON body the dsv4 servers read (a client's request, an upstream's answer). A
// 4 MiB body of brackets would otherwise nest a million levels deep, and one of "0," hold two
// million values; bodies are copied and printed recursively.
inline constexpr kvwire::JsonLimits kHttpJsonLimits = {.max_depth = 32, .max_values = 100000};

// Validates a request body; errors name the field and what is wrong (for a 400). The body
// is parsed within kHttpJsonLimits. Token ids of a prompt must be below `vocab_size`.
absl::StatusOr<CompletionRequest> ParseCompletionRequest(
    const std::string& body, int vocab_size, Endpoint endpoint = Endpoint::kCompletions);
// The same, for a body already parsed (with kvwire::ParseJsonObject and kHttpJsonLimits).
absl::StatusOr<CompletionRequest> CompletionRequestFromJson(
    const nlohmann::json& body, int vocab_size, Endpoint endpoint = Endpoint::kCompletions);

// Serialises JSON with invalid UTF-8 (byte tokens may split a character) replaced.
std::string Dump(const nlohmann::json& j);

// A completion (non-streamed) or one stream chunk: `text` is the detokenised `tokens`.
nlohmann::json CompletionJson(const std::string& id, const std::string& model,
                              const std::string& text, const std::vector<int32_t>& tokens,
                              const char* finish_reason);

// The answer in the shape of `endpoint`: a text_completion / chat.completion (chunk = false) or
// one stream chunk (a chat chunk carries the assistant role when `first_chunk`). Every choice
// also carries `token_ids` (as vLLM's return_token_ids does), its `logprobs` (null: none asked
// for; generation_output.h makes them) and its `index` (of n).
nlohmann::json ResponseJson(Endpoint endpoint, bool chunk, bool first_chunk, const std::string& id,
                            const std::string& model, const std::string& text,
                            const std::vector<int32_t>& tokens, const char* finish_reason,
                            const nlohmann::json& logprobs = nullptr, int index = 0);

// The stream's closing usage chunk (stream_options.include_usage): no choices, the usage.
nlohmann::json UsageChunkJson(Endpoint endpoint, const std::string& id, const std::string& model,
                              const nlohmann::json& usage);

// GET /v1/models: the one model a server runs.
nlohmann::json ModelsJson(const std::string& model, int max_model_len);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_COMPLETION_API_H_
