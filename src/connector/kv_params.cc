// kv_transfer_params JSON and mode negotiation.
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "kvwire/connector.h"

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

json BlocksJson(const BlockTable& t) {
  json blocks = json::object();
  for (const auto& [group, ids] : t) blocks[group] = ids;
  return blocks;
}

absl::Status ReadBlocks(const json& j, BlockTable* out) {
  if (!j.contains("block_ids")) return absl::OkStatus();
  const json& b = j.at("block_ids");
  if (!b.is_object()) {
    return absl::InvalidArgumentError("kv_transfer_params: block_ids is not an object");
  }
  for (const auto& [group, ids] : b.items()) (*out)[group] = ids.get<std::vector<int64_t>>();
  return absl::OkStatus();
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
  return j.dump();
}

absl::StatusOr<KvTransferParams> KvTransferParams::FromJson(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("kv_transfer_params: not a JSON object");
  }
  KvTransferParams p;
  try {
    p.engine_id = j.value("engine_id", "");
    p.host = j.value("remote_host", "");
    p.port = j.value("remote_port", 0);
    p.transfer_id = j.value("transfer_id", "");
    absl::StatusOr<KvMode> mode = ParseKvMode(j.value("mode", "auto"));
    if (!mode.ok()) return mode.status();
    p.mode = *mode;
    p.num_tokens = j.value("num_tokens", uint64_t{0});
    p.do_remote_decode = j.value("do_remote_decode", false);
    p.do_remote_prefill = j.value("do_remote_prefill", false);
    if (absl::Status s = ReadBlocks(j, &p.block_ids); !s.ok()) return s;
    if (j.contains("tp_sources")) {
      if (!j.at("tp_sources").is_array()) {
        return absl::InvalidArgumentError("kv_transfer_params: tp_sources is not a list");
      }
      for (const json& e : j.at("tp_sources")) {
        KvSource s;
        s.engine_id = e.value("engine_id", "");
        s.host = e.at("remote_host").get<std::string>();
        s.port = e.at("remote_port").get<int>();
        s.transfer_id = e.at("transfer_id").get<std::string>();
        if (absl::Status st = ReadBlocks(e, &s.block_ids); !st.ok()) return st;
        if (s.host.empty() || s.port <= 0 || s.port > 65535 || s.transfer_id.empty() ||
            s.block_ids.empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat("kv_transfer_params: tp_sources[", p.tp_sources.size(),
                           "] needs remote_host, remote_port, transfer_id and block_ids"));
        }
        p.tp_sources.push_back(std::move(s));
      }
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("kv_transfer_params: ", e.what()));
  }
  if (p.port < 0 || p.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("kv_transfer_params: bad port ", p.port));
  }
  if (p.do_remote_prefill) {
    if (p.host.empty() || p.port == 0) {
      return absl::InvalidArgumentError(
          "kv_transfer_params: remote_host/remote_port missing for a remote prefill");
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
