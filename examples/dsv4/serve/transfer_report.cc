#include "examples/dsv4/serve/transfer_report.h"

#include "src/util/log.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;

namespace {
constexpr char kLog[] = "dsv4-serve";
double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }
}  // namespace

json TransferJson(kvwire::Connector& connector, const std::string& request_id,
                  const std::string& transfer_id, const std::string& peer) {
  json out = {{"request_id", request_id}, {"transfer_id", transfer_id}, {"peer", peer}};
  json stats = json::parse(connector.StatsJson(), nullptr, false);
  if (!stats.is_discarded() && stats.contains("requests")) {
    for (const json& r : stats["requests"]) {
      if (r.value("request_id", "") != request_id) continue;
      uint64_t bytes = 0, pages = 0, ops = 0;
      for (const auto& [g, c] : r["groups"].items()) {
        bytes += c.value("bytes", uint64_t{0});
        pages += c.value("ops_before_merge", uint64_t{0});
        ops += c.value("ops", uint64_t{0});
      }
      const double first = r.value("first_byte_us", -1.0), last = r.value("last_byte_us", -1.0);
      const double ms = first >= 0 && last >= first ? (last - first) / 1e3 : 0.0;
      out["mode"] = r.value("mode", "");
      out["bytes"] = bytes;
      out["pages"] = pages;
      out["ops"] = ops;
      out["transfer_ms"] = ms;
      out["gbps"] = ms > 0 ? bytes / (ms / 1e3) / 1e9 : 0.0;
    }
  }
  for (const kvwire::PeerInfo& p : connector.engine().Peers()) {
    if ((p.address == peer || p.name == peer) && p.alive) out["transport"] = p.transport;
  }
  return out;
}

void AddWriteModeTransfer(const kvwire::Layout& layout, const kvwire::BlockTable& blocks,
                          uint64_t kv_tokens, std::optional<int64_t> prefill_computed_unix_us,
                          absl::Time load_end, json& transfer) {
  absl::StatusOr<kvwire::TransferPlan> plan =
      kvwire::PlanTransfer(layout, blocks, layout, blocks, kv_tokens);
  if (plan.ok()) {
    transfer["bytes"] = plan->bytes;
    transfer["pages"] = plan->ops_before_merge;
    transfer.erase("ops");
    transfer.erase("gbps");
  }
  if (prefill_computed_unix_us) {
    transfer["tail_ms"] = Ms(load_end - absl::FromUnixMicros(*prefill_computed_unix_us));
  }
}

bool CorruptLastMovedSwaPage(KvCache& cache, const kvwire::BlockTable& blocks, uint64_t kv_tokens,
                             const std::string& request_id) {
  const kvwire::CacheGroup* g = cache.layout().FindGroup("swa_kv");
  if (g == nullptr || g->layers.empty() || kv_tokens == 0) return false;
  const auto it = blocks.find("swa_kv");
  const uint64_t logical = (kv_tokens - 1) / g->tokens_per_block;
  if (it == blocks.end() || logical >= it->second.size()) return false;
  uint8_t* page = cache.Page("swa_kv", g->layers[0], it->second[logical]);
  if (page == nullptr) return false;
  const uint64_t entries = g->entries_per_block();
  for (uint64_t e = 0; e < entries; ++e) {
    for (uint64_t b = 0; b < 448; ++b) page[e * 576 + b] ^= 0x80;
  }
  KVW_LOG(kWarning, kLog) << "fault injection: corrupted a received KV page"
                          << Kv("request", request_id) << Kv("layer", g->layers[0])
                          << Kv("block", it->second[logical]);
  return true;
}

}  // namespace dsv4::serve
