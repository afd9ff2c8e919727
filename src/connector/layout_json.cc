// Layouts to and from JSON (nlohmann-json, Debian's nlohmann-json3-dev; used only here and in
// other .cc files of the connector, never in public headers).
#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "kvwire/layout.h"
#include "src/util/json_fields.h"

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
                      {"section_row_bytes", g.section_row_bytes},
                      {"layer_base", g.layer_base},
                      {"num_blocks", g.num_blocks},
                      {"block_stride", g.block_stride},
                      {"component_stride", g.component_stride}});
  }
  return {{"model", layout.model}, {"groups", std::move(groups)}};
}

absl::StatusOr<Layout> LayoutFromJsonValue(const json& j) {
  // Peers send their layout in the connector handshake: every field is typed and bounded
  // here, and Validate() checks what the fields mean together.
  constexpr int64_t kMaxInt = int64_t{1} << 30;
  constexpr uint64_t kMaxBytes = uint64_t{1} << 56;
  constexpr size_t kMaxGroups = 256, kMaxLayers = 4096;
  Layout layout;
  JsonFields f(j, "layout JSON");
  layout.model = f.OptString("model");
  const json* groups = f.Array("groups", /*required=*/true, kMaxGroups);
  for (size_t i = 0; groups != nullptr && i < groups->size() && f.ok(); ++i) {
    JsonFields jg = f.Item((*groups)[i], absl::StrCat("groups[", i, "]"));
    CacheGroup g;
    g.name = jg.String("name", 256);
    for (int64_t l : jg.IntArray("layers", /*required=*/true, 0, kMaxInt, kMaxLayers)) {
      g.layers.push_back(static_cast<int>(l));
    }
    g.tokens_per_block = static_cast<int>(jg.Int("tokens_per_block", 0, kMaxInt));
    g.page_bytes = jg.Uint("page_bytes", kMaxBytes);
    g.tokens_per_entry = static_cast<int>(jg.OptInt("tokens_per_entry", 0, kMaxInt, 1));
    g.window_tokens = static_cast<int>(jg.OptInt("window_tokens", 0, kMaxInt, 0));
    g.per_request_state = jg.OptBool("per_request_state", false);
    g.components = static_cast<int>(jg.OptInt("components", 0, 64, 1));
    g.block_major = jg.OptBool("block_major", true);
    JsonFields h = jg.Nested("heads", /*required=*/false);
    g.heads.total_heads = static_cast<int>(h.OptInt("total", 0, kMaxInt, 0));
    g.heads.tp_size = static_cast<int>(h.OptInt("tp_size", 0, kMaxInt, 1));
    g.heads.tp_rank = static_cast<int>(h.OptInt("tp_rank", 0, kMaxInt, 0));
    g.heads.outer = h.OptUint("outer", kMaxBytes, 1);
    g.heads.inner_bytes = h.OptUint("inner_bytes", kMaxBytes, 0);
    g.section_row_bytes = jg.UintArray("section_row_bytes", /*required=*/false, kMaxBytes, 4096);
    g.layer_base = jg.UintArray("layer_base", /*required=*/false,
                                std::numeric_limits<uint64_t>::max(), kMaxLayers);
    g.num_blocks = jg.OptUint("num_blocks", kMaxBytes, 0);
    g.block_stride = jg.OptUint("block_stride", kMaxBytes, 0);
    g.component_stride = jg.OptUint("component_stride", kMaxBytes, 0);
    layout.groups.push_back(std::move(g));
  }
  if (!f.ok()) return f.status();
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  return layout;
}

}  // namespace connector_internal

std::string LayoutToJson(const Layout& layout) {
  return DumpJson(connector_internal::LayoutToJsonValue(layout));
}

absl::StatusOr<Layout> LayoutFromJson(const std::string& text) {
  absl::StatusOr<json> j = ParseJsonObject(text, "layout JSON");
  if (!j.ok()) return j.status();
  return connector_internal::LayoutFromJsonValue(*j);
}

}  // namespace kvwire
