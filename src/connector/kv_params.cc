// kv_transfer_params JSON and mode negotiation.
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "kvwire/connector.h"
#include "src/connector/connector_impl.h"
#include "src/util/json_fields.h"

namespace kvwire {

using nlohmann::json;

const char* KvModeName(KvMode mode) {
  switch (mode) {
    case KvMode::kAuto:
      return "auto";
    case KvMode::kRead:
      return "read";
    case KvMode::kWrite:
      return "write";
  }
  return "?";
}

absl::StatusOr<KvMode> ParseKvMode(const std::string& name) {
  if (name == "auto" || name.empty()) return KvMode::kAuto;
  if (name == "read") return KvMode::kRead;
  if (name == "write") return KvMode::kWrite;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown kv transfer mode '", name, "' (read | write | auto)"));
}

absl::StatusOr<KvMode> NegotiateKvMode(KvMode prefill, KvMode decode) {
  if (prefill == KvMode::kAuto) return decode == KvMode::kAuto ? KvMode::kRead : decode;
  if (decode == KvMode::kAuto || decode == prefill) return prefill;
  return absl::FailedPreconditionError(absl::StrCat("kv transfer mode conflict: prefill is '",
                                                    KvModeName(prefill), "', decode is '",
                                                    KvModeName(decode), "'"));
}

namespace {

// Bounds on what kv_transfer_params (from a router, i.e. from the network) may hold.
using connector_internal::kMaxTransferIdBytes;
constexpr uint64_t kMaxTokens = uint64_t{1} << 40;
constexpr size_t kMaxTpSources = 256;
constexpr size_t kMaxNameBytes = 1024;  // engine ids, host names

// Group names "0", "1", ... "n-1": the table came from (or goes to) vLLM's per-group lists.
bool IndexedGroups(const BlockTable& t) {
  size_t i = 0;
  for (const auto& [group, ids] : t) {
    (void)ids;
    if (t.count(std::to_string(i++)) == 0) return false;
  }
  return true;
}

// remote_block_ids as vLLM's connectors read them: one list per KV cache group when the
// groups are vLLM's (named by index), else kvwire's object {group: ids}.
json BlocksJson(const BlockTable& t) {
  if (!t.empty() && IndexedGroups(t)) {
    json lists = json::array();
    for (size_t i = 0; i < t.size(); ++i) lists.push_back(t.at(std::to_string(i)));
    return lists;
  }
  json blocks = json::object();
  for (const auto& [group, ids] : t) blocks[group] = ids;
  return blocks;
}

// The blocks of `f`: "remote_block_ids" (object, flat list = group "0", or list of lists =
// groups "0", "1", ...) when present and not null, else "block_ids" (object).
BlockTable ParamsBlocks(JsonFields& f, const json& object) {
  constexpr size_t kMaxGroups = 256, kMaxIds = 1 << 20;
  constexpr int64_t kMaxBlockId = int64_t{1} << 40;
  if (!f.Has("remote_block_ids")) {
    return connector_internal::BlocksFromJson(f, "block_ids", /*required=*/false);
  }
  // Has() said `object` is an object holding the field.
  if (!object.find("remote_block_ids")->is_array()) {  // an object, or an error naming it
    return connector_internal::BlocksFromJson(f, "remote_block_ids", /*required=*/false);
  }
  BlockTable t;
  const json* a = f.Array("remote_block_ids", /*required=*/true, kMaxIds);
  if (a == nullptr || a->empty()) return t;
  const bool per_group = (*a)[0].is_array();
  if (per_group && a->size() > kMaxGroups) {
    f.Fail("remote_block_ids",
           absl::StrCat("has ", a->size(), " groups, over the limit of ", kMaxGroups));
    return t;
  }
  for (size_t g = 0; per_group && g < a->size() && f.ok(); ++g) {
    const json& ids = (*a)[g];
    const std::string name = absl::StrCat("remote_block_ids[", g, "]");
    if (!ids.is_array()) {
      f.Fail(name, "must be a list of block ids (every item a list, or every item an id)", ids);
      break;
    }
    if (ids.size() > kMaxIds) {
      f.Fail(name, absl::StrCat("has ", ids.size(), " ids, over the limit of ", kMaxIds));
      break;
    }
    std::vector<int64_t>& out = t[std::to_string(g)];
    for (size_t i = 0; i < ids.size() && f.ok(); ++i) {
      out.push_back(f.IntItem(ids[i], name, i, -1, kMaxBlockId));
    }
  }
  if (!per_group) {
    std::vector<int64_t>& out = t["0"];
    for (size_t i = 0; i < a->size() && f.ok(); ++i) {
      out.push_back(f.IntItem((*a)[i], "remote_block_ids", i, -1, kMaxBlockId));
    }
  }
  if (!f.ok()) t.clear();
  return t;
}

}  // namespace

void KvTransferParams::AddTpSource(const KvTransferParams& rank) {
  tp_sources.push_back({rank.engine_id, rank.host, rank.port, rank.transfer_id, rank.block_ids});
}

std::string KvTransferParams::ToJson() const {
  return DumpJson(connector_internal::ParamsToJsonValue(*this));
}

absl::StatusOr<KvTransferParams> KvTransferParams::FromJson(const std::string& text) {
  absl::StatusOr<json> j = ParseJsonObject(text, "kv_transfer_params");
  if (!j.ok()) return j.status();
  return connector_internal::ParamsFromJsonValue(*j);
}

namespace connector_internal {

json ParamsToJsonValue(const KvTransferParams& p) {
  // vLLM's names (NIXL, MoRIIO), so that a vLLM-style proxy can pass them on unchanged;
  // engine_id is kept for readers of the first version.
  json j = {
      {"version", 1},
      {"do_remote_decode", p.do_remote_decode},
      {"do_remote_prefill", p.do_remote_prefill},
      {"remote_engine_id", p.engine_id},
      {"engine_id", p.engine_id},
      {"remote_host", p.host},
      {"remote_port", p.port},
      {"remote_block_ids", BlocksJson(p.block_ids)},
      {"remote_request_id", p.remote_request_id.empty() ? p.transfer_id : p.remote_request_id},
      {"transfer_id", p.transfer_id},
      {"tp_size", p.tp_size},
      {"mode", KvModeName(p.mode)},
      {"num_tokens", p.num_tokens}};
  if (!p.tp_sources.empty()) {
    json sources = json::array();
    for (const KvSource& s : p.tp_sources) {
      sources.push_back({{"remote_engine_id", s.engine_id},
                         {"remote_host", s.host},
                         {"remote_port", s.port},
                         {"transfer_id", s.transfer_id},
                         {"remote_block_ids", BlocksJson(s.block_ids)}});
    }
    j["tp_sources"] = std::move(sources);
  }
  return j;
}

absl::StatusOr<KvTransferParams> ParamsFromJsonValue(const json& object) {
  KvTransferParams p;
  JsonFields f(object, "kv_transfer_params");  // a non-object fails it, and every read after
  p.engine_id = f.Has("remote_engine_id") ? f.OptString("remote_engine_id", "", kMaxNameBytes)
                                          : f.OptString("engine_id", "", kMaxNameBytes);
  p.host = f.OptString("remote_host", "", kMaxNameBytes);
  p.port = static_cast<int>(f.OptInt("remote_port", 0, 65535, 0));
  p.remote_request_id = f.OptString("remote_request_id", "", kMaxTransferIdBytes);
  p.transfer_id = f.OptString("transfer_id", "", kMaxTransferIdBytes);
  if (p.transfer_id.empty()) p.transfer_id = p.remote_request_id;
  p.tp_size = static_cast<int>(f.OptInt("tp_size", 1, kMaxTpSources, 1));
  const std::string mode_name = f.OptString("mode", "auto");
  if (absl::StatusOr<KvMode> mode = ParseKvMode(mode_name); mode.ok()) {
    p.mode = *mode;
  } else if (f.ok()) {
    f.Fail("mode", mode.status().message());
  }
  p.num_tokens = f.OptUint("num_tokens", kMaxTokens, 0);
  p.do_remote_decode = f.OptBool("do_remote_decode", false);
  p.do_remote_prefill = f.OptBool("do_remote_prefill", false);
  p.block_ids = ParamsBlocks(f, object);
  const json* sources = f.Array("tp_sources", /*required=*/false, kMaxTpSources);
  for (size_t i = 0; sources != nullptr && i < sources->size() && f.ok(); ++i) {
    JsonFields e = f.Item((*sources)[i], absl::StrCat("tp_sources[", i, "]"));
    KvSource s;
    s.engine_id = e.Has("remote_engine_id") ? e.OptString("remote_engine_id", "", kMaxNameBytes)
                                            : e.OptString("engine_id", "", kMaxNameBytes);
    s.host = e.String("remote_host", kMaxNameBytes);
    s.port = static_cast<int>(e.Int("remote_port", 1, 65535));
    s.transfer_id = e.String("transfer_id", kMaxTransferIdBytes);
    s.block_ids = ParamsBlocks(e, (*sources)[i]);
    if (!f.ok()) break;
    if (s.host.empty() || s.transfer_id.empty() || s.block_ids.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_transfer_params: tp_sources[", i,
                       "] needs remote_host, remote_port, transfer_id and block_ids"));
    }
    p.tp_sources.push_back(std::move(s));
  }
  if (!f.ok()) return f.status();
  if (p.port < 0 || p.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("kv_transfer_params: bad port ", p.port));
  }
  if (p.do_remote_prefill) {
    // Without host and port the engine id names the prefill; the connector resolves it
    // through discovery (etcd) or refuses the request.
    if ((p.host.empty() || p.port == 0) && p.engine_id.empty()) {
      return absl::InvalidArgumentError(
          "kv_transfer_params: remote_host/remote_port (or an engine_id to resolve) missing for "
          "a remote prefill");
    }
    if (p.transfer_id.empty()) {
      return absl::InvalidArgumentError(
          "kv_transfer_params: transfer_id (or remote_request_id) missing for a remote prefill");
    }
    // num_tokens may be absent (vLLM's connectors do not send it): the whole prompt moves.
    if (p.mode == KvMode::kRead && p.block_ids.empty()) {
      return absl::InvalidArgumentError("kv_transfer_params: read mode without block_ids");
    }
  }
  return p;
}

}  // namespace connector_internal
}  // namespace kvwire
