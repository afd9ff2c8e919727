// Layouts to and from JSON (nlohmann-json, Debian's nlohmann-json3-dev; used only here and in
// other .cc files of the connector, never in public headers).
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "kvwire/layout.h"

namespace kvwire {

using nlohmann::json;

namespace connector_internal {

json LayoutToJsonValue(const Layout& layout) {
  json groups = json::array();
  for (const CacheGroup& g : layout.groups) {
    groups.push_back({{"name", g.name},
                      {"layers", g.layers},
                      {"tokens_per_block", g.tokens_per_block},
                      {"page_bytes", g.page_bytes},
                      {"tokens_per_entry", g.tokens_per_entry},
                      {"window_tokens", g.window_tokens},
                      {"per_request_state", g.per_request_state},
                      {"components", g.components},
                      {"block_major", g.block_major},
                      {"heads",
                       {{"total", g.heads.total_heads},
                        {"tp_size", g.heads.tp_size},
                        {"tp_rank", g.heads.tp_rank},
                        {"outer", g.heads.outer},
                        {"inner_bytes", g.heads.inner_bytes}}},
                      {"layer_base", g.layer_base},
                      {"num_blocks", g.num_blocks},
                      {"block_stride", g.block_stride},
                      {"component_stride", g.component_stride}});
  }
  return {{"model", layout.model}, {"groups", std::move(groups)}};
}

absl::StatusOr<Layout> LayoutFromJsonValue(const json& j) {
  Layout layout;
  try {
    if (!j.is_object()) return absl::InvalidArgumentError("layout JSON: not an object");
    layout.model = j.value("model", "");
    if (!j.contains("groups") || !j.at("groups").is_array()) {
      return absl::InvalidArgumentError("layout JSON: missing 'groups' array");
    }
    for (const json& jg : j.at("groups")) {
      CacheGroup g;
      g.name = jg.at("name").get<std::string>();
      g.layers = jg.at("layers").get<std::vector<int>>();
      g.tokens_per_block = jg.at("tokens_per_block").get<int>();
      g.page_bytes = jg.at("page_bytes").get<uint64_t>();
      g.tokens_per_entry = jg.value("tokens_per_entry", 1);
      g.window_tokens = jg.value("window_tokens", 0);
      g.per_request_state = jg.value("per_request_state", false);
      g.components = jg.value("components", 1);
      g.block_major = jg.value("block_major", true);
      if (jg.contains("heads")) {
        const json& h = jg.at("heads");
        g.heads.total_heads = h.value("total", 0);
        g.heads.tp_size = h.value("tp_size", 1);
        g.heads.tp_rank = h.value("tp_rank", 0);
        g.heads.outer = h.value("outer", uint64_t{1});
        g.heads.inner_bytes = h.value("inner_bytes", uint64_t{0});
      }
      g.layer_base = jg.value("layer_base", std::vector<uint64_t>{});
      g.num_blocks = jg.value("num_blocks", uint64_t{0});
      g.block_stride = jg.value("block_stride", uint64_t{0});
      g.component_stride = jg.value("component_stride", uint64_t{0});
      layout.groups.push_back(std::move(g));
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("layout JSON: ", e.what()));
  }
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  return layout;
}

}  // namespace connector_internal

std::string LayoutToJson(const Layout& layout) {
  return connector_internal::LayoutToJsonValue(layout).dump();
}

absl::StatusOr<Layout> LayoutFromJson(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("layout JSON: parse error");
  return connector_internal::LayoutFromJsonValue(j);
}

}  // namespace kvwire
