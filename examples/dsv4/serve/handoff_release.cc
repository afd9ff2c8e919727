#include "examples/dsv4/serve/handoff_release.h"

#include "src/util/json_fields.h"

namespace dsv4::serve {

using nlohmann::json;

std::optional<std::string> UnreadHandOff(const json& kv_transfer_params) {
  if (!kv_transfer_params.is_object()) return std::nullopt;
  json params = json::object();
  for (const auto& [key, value] : kv_transfer_params.items()) {
    if (!value.is_null()) params[key] = value;
  }
  kvwire::JsonFields f(params, "kv_transfer_params");
  const bool remote_prefill = f.OptBool("do_remote_prefill", false);
  const std::string tid = f.OptString("transfer_id", "", kMaxIdBytes);
  const std::string mode = f.OptString("mode", "", 16);
  if (!f.ok() || !remote_prefill || tid.empty() || mode == "write") return std::nullopt;
  return kvwire::DumpJson(params);
}

std::optional<std::string> UnreadHandOffInBody(const std::string& body) {
  absl::StatusOr<json> j = kvwire::ParseJsonObject(body, "request body", kHttpJsonLimits);
  if (!j.ok()) return std::nullopt;
  const auto it = j->find("kv_transfer_params");
  if (it == j->end()) return std::nullopt;
  return UnreadHandOff(*it);
}

}  // namespace dsv4::serve
