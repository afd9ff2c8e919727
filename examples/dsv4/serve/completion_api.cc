#include "examples/dsv4/serve/completion_api.h"

#include <ctime>

#include "absl/strings/str_cat.h"

#include "examples/dsv4/serve/json_fields.h"

namespace dsv4::serve {

using nlohmann::json;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

namespace {

absl::Status ParseKvTransferFields(const json& params, KvTransferFields* out) {
  const JsonFields f(params, "kv_transfer_params.");
  absl::Status s = f.Bool("do_remote_decode", &out->do_remote_decode);
  if (s.ok()) s = f.Bool("do_remote_prefill", &out->do_remote_prefill);
  if (s.ok()) s = f.String("mode", 16, &out->mode);
  if (s.ok() && !out->mode.empty() && out->mode != "auto" && out->mode != "read" &&
      out->mode != "write") {
    s = f.Bad("mode", "\"read\", \"write\" or \"auto\"");
  }
  if (s.ok()) s = f.String("transfer_id", kMaxIdBytes, &out->transfer_id);
  if (s.ok()) s = f.String("remote_host", kMaxIdBytes, &out->remote_host);
  int64_t port = 0;
  if (s.ok()) s = f.Int("remote_port", 0, 65535, &port);
  out->remote_port = static_cast<int>(port);
  if (s.ok()) s = f.Uint("num_tokens", uint64_t{1} << 32, &out->num_tokens);
  // Read by the connector only; checked here too so that its error names the field.
  std::string engine_id;
  if (s.ok()) s = f.String("engine_id", kMaxIdBytes, &engine_id);
  return s;
}

}  // namespace

absl::StatusOr<CompletionRequest> ParseCompletionRequest(const std::string& body, int vocab_size) {
  absl::StatusOr<json> j = ParseJsonBounded(body, "request body");
  if (!j.ok()) return j.status();
  return CompletionRequestFromJson(*j, vocab_size);
}

absl::StatusOr<CompletionRequest> CompletionRequestFromJson(const json& j, int vocab_size) {
  if (!j.is_object()) return absl::InvalidArgumentError("request body must be a JSON object");
  CompletionRequest r;
  const JsonFields f(j, "");
  if (!f.Has("prompt")) return absl::InvalidArgumentError("'prompt' is required");
  const json& p = j.at("prompt");
  if (p.is_string()) {
    r.prompt = p.get<std::string>();
  } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
    r.prompt = p[0].get<std::string>();
  } else {
    return f.Bad("prompt", "a string (or an array of one string)");
  }
  int64_t max_tokens = r.max_tokens;
  absl::Status s = f.Int("max_tokens", 1, 1000000, &max_tokens);
  r.max_tokens = static_cast<int>(max_tokens);
  double temperature = r.temperature;
  if (s.ok()) s = f.Number("temperature", 0, 100, &temperature);
  r.temperature = static_cast<float>(temperature);
  if (s.ok()) s = f.Uint("seed", UINT64_MAX, &r.seed);
  if (s.ok()) s = f.Bool("stream", &r.stream);
  if (s.ok()) s = f.String("model", kMaxIdBytes, &r.model);
  const json* kvp = nullptr;
  if (s.ok()) s = f.Object("kv_transfer_params", &kvp);
  if (s.ok() && kvp != nullptr) {
    r.kv_transfer_params = *kvp;
    s = ParseKvTransferFields(*kvp, &r.kv);
  }
  std::optional<int64_t> first_token;
  if (s.ok()) s = f.Int("first_token", 0, int64_t{vocab_size} - 1, &first_token);
  if (first_token) r.first_token = static_cast<int32_t>(*first_token);
  const json* prefill = nullptr;
  if (s.ok()) s = f.Object("kvwire_prefill", &prefill);
  if (s.ok() && prefill != nullptr) {
    r.prefill_stats = *prefill;
    s = JsonFields(*prefill, "kvwire_prefill.")
            .Int("computed_unix_us", 0, INT64_MAX / 2, &r.prefill_computed_unix_us);
  }
  if (!s.ok()) return s;
  return r;
}

json CompletionJson(const std::string& id, const std::string& model, const std::string& text,
                    const std::vector<int32_t>& tokens, const char* finish_reason) {
  json choice = {{"index", 0},
                 {"text", text},
                 {"token_ids", tokens},
                 {"logprobs", nullptr},
                 {"finish_reason", finish_reason == nullptr ? json(nullptr) : json(finish_reason)}};
  return {{"id", id},
          {"object", "text_completion"},
          {"created", static_cast<int64_t>(std::time(nullptr))},
          {"model", model},
          {"choices", json::array({choice})}};
}

}  // namespace dsv4::serve
