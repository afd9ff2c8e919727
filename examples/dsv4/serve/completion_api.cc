#include "examples/dsv4/serve/completion_api.h"

#include <ctime>

#include "absl/strings/str_cat.h"

namespace dsv4::serve {

using nlohmann::json;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

absl::StatusOr<CompletionRequest> ParseCompletionRequest(const std::string& body, int vocab_size) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("request body is not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("request body must be a JSON object");
  CompletionRequest r;
  auto bad = [](const char* field, const char* want) {
    return absl::InvalidArgumentError(absl::StrCat("'", field, "' must be ", want));
  };
  if (!j.contains("prompt")) return absl::InvalidArgumentError("'prompt' is required");
  const json& p = j.at("prompt");
  if (p.is_string()) {
    r.prompt = p.get<std::string>();
  } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
    r.prompt = p[0].get<std::string>();
  } else {
    return bad("prompt", "a string (or an array of one string)");
  }
  if (j.contains("max_tokens") && !j.at("max_tokens").is_null()) {
    const json& m = j.at("max_tokens");
    if (!m.is_number_integer() || m.get<int64_t>() < 1 || m.get<int64_t>() > 1000000) {
      return bad("max_tokens", "an integer >= 1");
    }
    r.max_tokens = static_cast<int>(m.get<int64_t>());
  }
  if (j.contains("temperature") && !j.at("temperature").is_null()) {
    const json& t = j.at("temperature");
    if (!t.is_number() || t.get<double>() < 0 || t.get<double>() > 100) {
      return bad("temperature", "a number in [0, 100]");
    }
    r.temperature = t.get<float>();
  }
  if (j.contains("seed") && !j.at("seed").is_null()) {
    const json& s = j.at("seed");
    if (!s.is_number_integer() ||
        (s.is_number_integer() && !s.is_number_unsigned() && s.get<int64_t>() < 0)) {
      return bad("seed", "a non-negative integer");
    }
    r.seed = s.get<uint64_t>();
  }
  if (j.contains("stream") && !j.at("stream").is_null()) {
    if (!j.at("stream").is_boolean()) return bad("stream", "a boolean");
    r.stream = j.at("stream").get<bool>();
  }
  if (j.contains("model") && j.at("model").is_string()) r.model = j.at("model").get<std::string>();
  if (j.contains("kv_transfer_params") && !j.at("kv_transfer_params").is_null()) {
    if (!j.at("kv_transfer_params").is_object()) return bad("kv_transfer_params", "an object");
    r.kv_transfer_params = j.at("kv_transfer_params");
  }
  if (j.contains("first_token") && !j.at("first_token").is_null()) {
    const json& f = j.at("first_token");
    if (!f.is_number_integer() || f.get<int64_t>() < 0 || f.get<int64_t>() >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("'first_token' must be a token id in [0, ", vocab_size, ")"));
    }
    r.first_token = static_cast<int32_t>(f.get<int64_t>());
  }
  if (j.contains("kvwire_prefill") && j.at("kvwire_prefill").is_object()) {
    r.prefill_stats = j.at("kvwire_prefill");
  }
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
