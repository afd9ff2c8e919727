#include "src/discovery/instance.h"

#include "absl/strings/str_cat.h"

#include "src/discovery/etcd_json.h"
#include "src/util/json_fields.h"

namespace kvwire::discovery {

using nlohmann::json;

absl::Status CheckName(absl::string_view what, absl::string_view name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be 1 to 128 characters"));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " '", name, "' may hold only letters, digits, '.', '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

std::string ClusterPrefix(absl::string_view cluster) {
  return absl::StrCat("/kvwire/", cluster, "/instances/");
}

std::string InstanceKey(absl::string_view cluster, absl::string_view name) {
  return absl::StrCat(ClusterPrefix(cluster), name);
}

std::string InstanceRecord::ToJson() const {
  json j = {{"name", name},
            {"role", role},
            {"kv_address", kv_address},
            {"http_address", http_address},
            {"transports", transports},
            {"mode", mode},
            {"compat_hash", compat_hash},
            {"pid", pid}};
  if (layout.is_object()) j["layout"] = layout;
  return DumpJson(j);
}

absl::StatusOr<InstanceRecord> InstanceRecord::FromJson(absl::string_view text) {
  const JsonLimits limits{.max_bytes = kEtcdMaxValueBytes, .max_depth = 6, .max_values = 4096};
  absl::StatusOr<json> j = ParseJsonObject(text, "instance record", limits);
  if (!j.ok()) return j.status();
  JsonFields f(*j, "instance record");
  InstanceRecord r;
  r.name = f.String("name", 128);
  r.role = f.String("role", 16);
  r.kv_address = f.OptString("kv_address", "", 300);
  r.http_address = f.OptString("http_address", "", 300);
  const json* transports = f.Array("transports", /*required=*/false, 8);
  for (size_t i = 0; transports != nullptr && i < transports->size() && f.ok(); ++i) {
    r.transports.push_back(f.StringValue((*transports)[i], "transports[]", 32));
  }
  r.mode = f.OptString("mode", "auto", 16);
  r.compat_hash = f.OptString("compat_hash", "", 64);
  const json* layout = f.Object("layout", /*required=*/false);
  r.pid = f.OptInt("pid", 0, INT32_MAX, 0);
  if (!f.ok()) return f.status();
  if (layout != nullptr) r.layout = *layout;
  if (absl::Status s = CheckName("instance name", r.name); !s.ok()) return s;
  if (r.role != "prefill" && r.role != "decode" && r.role != "both") {
    return absl::InvalidArgumentError(
        absl::StrCat("instance record: role must be prefill, decode or both, not '", r.role, "'"));
  }
  return r;
}

}  // namespace kvwire::discovery
