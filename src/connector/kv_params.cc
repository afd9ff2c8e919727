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

json BlocksJson(const BlockTable& t) {
  json blocks = json::object();
  for (const auto& [group, ids] : t) blocks[group] = ids;
  return blocks;
}

}  // namespace

void KvTransferParams::AddTpSource(const KvTransferParams& rank) {
  tp_sources.push_back({rank.engine_id, rank.host, rank.port, rank.transfer_id, rank.block_ids});
}

std::string KvTransferParams::ToJson() const {
  json blocks = BlocksJson(block_ids);
  json j = {{"version", 1},
            {"engine_id", engine_id},
            {"remote_host", host},
            {"remote_port", port},
            {"transfer_id", transfer_id},
            {"mode", KvModeName(mode)},
            {"num_tokens", num_tokens},
            {"block_ids", std::move(blocks)},
            {"do_remote_decode", do_remote_decode},
            {"do_remote_prefill", do_remote_prefill}};
  if (!tp_sources.empty()) {
    json sources = json::array();
    for (const KvSource& s : tp_sources) {
      sources.push_back({{"engine_id", s.engine_id},
                         {"remote_host", s.host},
                         {"remote_port", s.port},
                         {"transfer_id", s.transfer_id},
                         {"block_ids", BlocksJson(s.block_ids)}});
    }
    j["tp_sources"] = std::move(sources);
  }
  return DumpJson(j);
}

absl::StatusOr<KvTransferParams> KvTransferParams::FromJson(const std::string& text) {
  absl::StatusOr<json> j = ParseJsonObject(text, "kv_transfer_params");
  if (!j.ok()) return j.status();
  KvTransferParams p;
  JsonFields f(*j, "kv_transfer_params");
  p.engine_id = f.OptString("engine_id");
  p.host = f.OptString("remote_host");
  p.port = static_cast<int>(f.OptInt("remote_port", 0, 65535, 0));
  p.transfer_id = f.OptString("transfer_id", "", kMaxTransferIdBytes);
  const std::string mode_name = f.OptString("mode", "auto");
  if (absl::StatusOr<KvMode> mode = ParseKvMode(mode_name); mode.ok()) {
    p.mode = *mode;
  } else if (f.ok()) {
    f.Fail("mode", mode.status().message());
  }
  p.num_tokens = f.OptUint("num_tokens", kMaxTokens, 0);
  p.do_remote_decode = f.OptBool("do_remote_decode", false);
  p.do_remote_prefill = f.OptBool("do_remote_prefill", false);
  p.block_ids = connector_internal::BlocksFromJson(f, "block_ids", /*required=*/false);
  const json* sources = f.Array("tp_sources", /*required=*/false, kMaxTpSources);
  for (size_t i = 0; sources != nullptr && i < sources->size() && f.ok(); ++i) {
    JsonFields e = f.Item((*sources)[i], absl::StrCat("tp_sources[", i, "]"));
    KvSource s;
    s.engine_id = e.OptString("engine_id");
    s.host = e.String("remote_host");
    s.port = static_cast<int>(e.Int("remote_port", 1, 65535));
    s.transfer_id = e.String("transfer_id", kMaxTransferIdBytes);
    s.block_ids = connector_internal::BlocksFromJson(e, "block_ids", /*required=*/false);
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
      return absl::InvalidArgumentError("kv_transfer_params: transfer_id missing");
    }
    if (p.num_tokens == 0) {
      return absl::InvalidArgumentError("kv_transfer_params: num_tokens missing");
    }
    if (p.mode == KvMode::kRead && p.block_ids.empty()) {
      return absl::InvalidArgumentError("kv_transfer_params: read mode without block_ids");
    }
  }
  return p;
}

}  // namespace kvwire
