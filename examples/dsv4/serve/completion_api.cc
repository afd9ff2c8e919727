#include "examples/dsv4/serve/completion_api.h"

#include <ctime>
#include <set>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "examples/dsv4/serve/chat_template.h"
#include "src/util/json_fields.h"

namespace dsv4::serve {

using kvwire::JsonFields;
using nlohmann::json;

std::string Dump(const json& j) { return kvwire::DumpJson(j); }

const char* EndpointPath(Endpoint e) {
  return e == Endpoint::kChat ? "/v1/chat/completions" : "/v1/completions";
}

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

// Parameters the servers act on, per endpoint.
const std::set<std::string_view>& Supported(Endpoint e) {
  static const std::set<std::string_view> common = {"model",
                                                    "max_tokens",
                                                    "temperature",
                                                    "top_p",
                                                    "top_k",
                                                    "min_p",
                                                    "seed",
                                                    "presence_penalty",
                                                    "frequency_penalty",
                                                    "repetition_penalty",
                                                    "ignore_eos",
                                                    "min_tokens",
                                                    "logprobs",
                                                    "n",
                                                    "stream",
                                                    "stream_options",
                                                    "stop",
                                                    "kv_transfer_params",
                                                    "kvwire_prefill",
                                                    "user",
                                                    "return_tokens_as_token_ids"};
  static const std::set<std::string_view> completions = [] {
    std::set<std::string_view> s = common;
    s.insert({"prompt", "echo"});
    return s;
  }();
  static const std::set<std::string_view> chat = [] {
    std::set<std::string_view> s = common;
    s.insert({"messages", "max_completion_tokens", "top_logprobs", "echo"});
    return s;
  }();
  return e == Endpoint::kChat ? chat : completions;
}

// Parameters accepted only at the value that means "off" (what the servers do anyway): a
// client that sends the default is served, one that asks for more is told.
bool IsDefault(std::string_view name, const json& v) {
  auto number_is = [&](double want) { return v.is_number() && v.get<double>() == want; };
  if (name == "best_of") return number_is(1);
  if (name == "min_completion_tokens") return number_is(0);
  if (name == "prompt_logprobs") return number_is(0);
  if (name == "logit_bias") return v.is_object() && v.empty();
  if (name == "suffix") return v.is_string() && v.get<std::string>().empty();
  return false;
}

// Refuses, naming them all, the non-null fields of `body` the endpoint does not support.
void RefuseUnsupported(JsonFields& f, const json& body, Endpoint e) {
  std::vector<std::string> bad;
  for (const auto& [key, value] : body.items()) {
    if (value.is_null() || Supported(e).count(key) != 0 || IsDefault(key, value)) continue;
    bad.push_back(key);
  }
  if (bad.empty()) return;
  f.Fail(bad.front(), absl::StrCat("is not supported by this server (unsupported parameters: '",
                                   absl::StrJoin(bad, "', '"), "')"));
}

// `prompt`: a string, an array of one string, an array of token ids, or an array of one such
// array (OpenAI's forms for a single prompt).
void ParsePrompt(JsonFields& f, const json& j, int vocab_size, CompletionRequest* r) {
  const auto it = j.find("prompt");
  if (it == j.end() || it->is_null()) {
    f.Fail("prompt", "is required");
    return;
  }
  const json* p = &*it;
  if (p->is_string()) {
    r->prompt = p->get<std::string>();
    return;
  }
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) {
    if ((*p)[0].is_string()) {
      r->prompt = (*p)[0].get<std::string>();
      return;
    }
    p = &(*p)[0];
  }
  if (!p->is_array() || p->empty() || p->size() > kMaxPromptTokens) {
    f.Fail("prompt",
           "must be a string, an array of one string, or a non-empty array of token ids "
           "(one prompt per request)",
           *it);
    return;
  }
  std::vector<int32_t> ids;
  ids.reserve(p->size());
  for (size_t i = 0; i < p->size(); ++i) {
    const json& t = (*p)[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab_size) {
      f.Fail(
          "prompt",
          absl::StrCat("token ids must be integers in [0, ", vocab_size, "); item ", i, " is not"),
          t);
      return;
    }
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  r->prompt_ids = std::move(ids);
}

void ParseStop(JsonFields& f, const json& j, CompletionRequest* r) {
  const auto it = j.find("stop");
  if (it == j.end() || it->is_null()) return;
  if (it->is_string()) {
    r->stop.push_back(f.String("stop", kMaxStopBytes));
  } else {
    const json* a = f.Array("stop", /*required=*/true, kMaxStopStrings);
    for (size_t i = 0; a != nullptr && i < a->size() && f.ok(); ++i) {
      r->stop.push_back(f.StringValue((*a)[i], absl::StrCat("stop[", i, "]"), kMaxStopBytes));
    }
  }
  for (const std::string& s : r->stop) {
    if (f.ok() && s.empty()) f.Fail("stop", "must not hold an empty string");
  }
}

}  // namespace

absl::StatusOr<CompletionRequest> ParseCompletionRequest(const std::string& body, int vocab_size,
                                                         Endpoint endpoint) {
  absl::StatusOr<json> j = kvwire::ParseJsonObject(body, "request body", kHttpJsonLimits);
  if (!j.ok()) return j.status();
  return CompletionRequestFromJson(*j, vocab_size, endpoint);
}

absl::StatusOr<CompletionRequest> CompletionRequestFromJson(const json& j, int vocab_size,
                                                            Endpoint endpoint) {
  JsonFields f(j, "request body");
  if (!f.ok()) return f.status();
  CompletionRequest r;
  r.endpoint = endpoint;
  if (endpoint == Endpoint::kChat) {
    r.prompt = ApplyChatTemplate(f);
  } else {
    ParsePrompt(f, j, vocab_size, &r);
  }
  r.max_tokens = static_cast<int>(f.OptInt("max_tokens", 1, 1000000, r.max_tokens));
  if (endpoint == Endpoint::kChat && f.Has("max_completion_tokens")) {
    // vLLM: max_completion_tokens, when given, wins over the deprecated max_tokens.
    r.max_tokens = static_cast<int>(f.Int("max_completion_tokens", 1, 1000000));
  }
  r.stream = f.OptBool("stream", r.stream);
  r.model = f.OptString("model", r.model, kMaxIdBytes);
  ParseStop(f, j, &r);
  if (f.ok() && f.Has("stream_options")) {
    if (!r.stream) {
      f.Fail("stream_options", "is only allowed with \"stream\": true");
    } else {
      JsonFields so = f.Nested("stream_options", /*required=*/true);
      r.include_usage = so.OptBool("include_usage", false);
      if (so.ok() && so.OptBool("continuous_usage_stats", false)) {
        so.Fail("continuous_usage_stats", "is not supported (include_usage is)");
      }
      const json& options = j.at("stream_options");
      for (auto it = options.begin(); so.ok() && options.is_object() && it != options.end(); ++it) {
        if (it.key() != "include_usage" && it.key() != "continuous_usage_stats" &&
            !it.value().is_null()) {
          so.Fail(it.key(), "is not supported (include_usage is)");
        }
      }
    }
  }
  const json* kvp = f.Object("kv_transfer_params", /*required=*/false);
  if (!f.ok()) return f.status();
  if (kvp != nullptr) {
    // vLLM's proxies send the fields prefill fills in as nulls: null means not given.
    r.kv_transfer_params = json::object();
    for (const auto& [key, value] : kvp->items()) {
      if (!value.is_null()) r.kv_transfer_params[key] = value;
    }
    if (absl::Status s = ParseKvTransferFields(*kvp, &r.kv); !s.ok()) return s;
  }
  ParseSamplingParams(f, j, endpoint, r.max_tokens, r.kv.do_remote_decode, &r.sampling);
  if (!f.ok()) return f.status();
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
  // Last: a request that is wrong in a supported field hears about that field first.
  RefuseUnsupported(f, j, endpoint);
  if (!f.ok()) return f.status();
  return r;
}

json CompletionJson(const std::string& id, const std::string& model, const std::string& text,
                    const std::vector<int32_t>& tokens, const char* finish_reason) {
  return ResponseJson(Endpoint::kCompletions, false, false, id, model, text, tokens, finish_reason);
}

json ResponseJson(Endpoint endpoint, bool chunk, bool first_chunk, const std::string& id,
                  const std::string& model, const std::string& text,
                  const std::vector<int32_t>& tokens, const char* finish_reason,
                  const json& logprobs, int index) {
  const json reason = finish_reason == nullptr ? json(nullptr) : json(finish_reason);
  json choice = {{"index", index}, {"token_ids", tokens}, {"logprobs", logprobs}};
  const char* object = "text_completion";
  if (endpoint == Endpoint::kChat) {
    object = chunk ? "chat.completion.chunk" : "chat.completion";
    if (chunk) {
      json delta = {{"content", text}};
      if (first_chunk) delta["role"] = "assistant";
      choice["delta"] = std::move(delta);
    } else {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    }
  } else {
    choice["text"] = text;
  }
  choice["finish_reason"] = reason;
  return {{"id", id},
          {"object", object},
          {"created", static_cast<int64_t>(std::time(nullptr))},
          {"model", model},
          {"choices", json::array({std::move(choice)})}};
}

json UsageChunkJson(Endpoint endpoint, const std::string& id, const std::string& model,
                    const json& usage) {
  return {{"id", id},
          {"object", endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", static_cast<int64_t>(std::time(nullptr))},
          {"model", model},
          {"choices", json::array()},
          {"usage", usage}};
}

json ModelsJson(const std::string& model, int max_model_len) {
  return {{"object", "list"},
          {"data", json::array({{{"id", model},
                                 {"object", "model"},
                                 {"created", static_cast<int64_t>(std::time(nullptr))},
                                 {"owned_by", "kvwire"},
                                 {"root", model},
                                 {"max_model_len", max_model_len}}})}};
}

}  // namespace dsv4::serve
