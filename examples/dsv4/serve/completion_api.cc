#include "examples/dsv4/serve/completion_api.h"

#include <ctime>

#include "src/util/json_fields.h"

namespace dsv4::serve {

using kvwire::JsonFields;
using nlohmann::json;

std::string Dump(const json& j) { return kvwire::DumpJson(j); }

namespace {

// Named as the connector names the object, so that both report a bad field the same way.
absl::Status ParseKvTransferFields(const json& params, KvTransferFields* out) {
  JsonFields f(params, "kv_transfer_params");
  out->do_remote_decode = f.OptBool("do_remote_decode", out->do_remote_decode);
  out->do_remote_prefill = f.OptBool("do_remote_prefill", out->do_remote_prefill);
  out->mode = f.OptString("mode", out->mode, 16);
  if (f.ok() && !out->mode.empty() && out->mode != "auto" && out->mode != "read" &&
      out->mode != "write") {
    f.Fail("mode", "must be \"read\", \"write\" or \"auto\"", json(out->mode));
  }
  out->transfer_id = f.OptString("transfer_id", out->transfer_id, kMaxIdBytes);
  out->remote_host = f.OptString("remote_host", out->remote_host, kMaxIdBytes);
  out->remote_port = static_cast<int>(f.OptInt("remote_port", 0, 65535, out->remote_port));
  out->num_tokens = f.OptUint("num_tokens", uint64_t{1} << 32, out->num_tokens);
  // Read by the connector only; checked here too so that its error names the field.
  f.OptString("engine_id", "", kMaxIdBytes);
  return f.status();
}

}  // namespace

absl::StatusOr<CompletionRequest> ParseCompletionRequest(const std::string& body, int vocab_size) {
  absl::StatusOr<json> j = kvwire::ParseJsonObject(body, "request body", kHttpJsonLimits);
  if (!j.ok()) return j.status();
  return CompletionRequestFromJson(*j, vocab_size);
}

absl::StatusOr<CompletionRequest> CompletionRequestFromJson(const json& j, int vocab_size) {
  JsonFields f(j, "request body");
  if (!f.ok()) return f.status();
  CompletionRequest r;
  if (!f.Has("prompt")) {
    f.Fail("prompt", "is required");
  } else {
    const json& p = *j.find("prompt");
    if (p.is_string()) {
      r.prompt = p.get<std::string>();
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      r.prompt = p[0].get<std::string>();
    } else {
      f.Fail("prompt", "must be a string (or an array of one string)", p);
    }
  }
  r.max_tokens = static_cast<int>(f.OptInt("max_tokens", 1, 1000000, r.max_tokens));
  r.temperature = static_cast<float>(f.OptNumber("temperature", 0, 100, r.temperature));
  r.seed = f.OptUint("seed", UINT64_MAX, r.seed);
  r.stream = f.OptBool("stream", r.stream);
  r.model = f.OptString("model", r.model, kMaxIdBytes);
  const json* kvp = f.Object("kv_transfer_params", /*required=*/false);
  if (!f.ok()) return f.status();
  if (kvp != nullptr) {
    r.kv_transfer_params = *kvp;
    if (absl::Status s = ParseKvTransferFields(*kvp, &r.kv); !s.ok()) return s;
  }
  if (f.Has("first_token")) {
    r.first_token = static_cast<int32_t>(f.Int("first_token", 0, int64_t{vocab_size} - 1));
  }
  const json* prefill = f.Object("kvwire_prefill", /*required=*/false);
  if (!f.ok()) return f.status();
  if (prefill != nullptr) {
    r.prefill_stats = *prefill;
    JsonFields p(*prefill, "kvwire_prefill");
    if (p.Has("computed_unix_us")) {
      r.prefill_computed_unix_us = p.Int("computed_unix_us", 0, INT64_MAX / 2);
    }
    if (!p.ok()) return p.status();
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
