// Layout JSON (src/connector/layout_json.cc): a connector peer sends its KV layout in its
// hello; the layout is validated, checked against the local one, and planned against with the
// block tables the peer sends later. This target parses the input as a layout and, when it
// validates, runs it through what the connector does with a peer's layout: a round trip,
// CheckCompatible, and PlanTransfer with block tables covering up to 8 blocks per group.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvwire/layout.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvwire::Layout> layout = kvwire::LayoutFromJson(text);
  if (!layout.ok()) {
    KVWIRE_FUZZ_CHECK(layout.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  absl::StatusOr<kvwire::Layout> again = kvwire::LayoutFromJson(kvwire::LayoutToJson(*layout));
  KVWIRE_FUZZ_CHECK(again.ok());
  KVWIRE_FUZZ_CHECK(kvwire::LayoutToJson(*again) == kvwire::LayoutToJson(*layout));
  if (!kvwire::CheckCompatible(*layout, *again).ok()) return 0;

  kvwire::BlockTable blocks;
  uint64_t tokens = UINT64_MAX;
  for (const kvwire::CacheGroup& g : layout->groups) {
    const uint64_t n = std::min<uint64_t>(g.num_blocks, 8);
    auto& ids = blocks[g.name];
    for (uint64_t b = 0; b < n; ++b) ids.push_back(static_cast<int64_t>(b));
    if (g.tokens_per_block > 0) tokens = std::min<uint64_t>(tokens, n * g.tokens_per_block);
  }
  if (tokens == UINT64_MAX) tokens = 0;
  absl::StatusOr<kvwire::TransferPlan> plan =
      kvwire::PlanTransfer(*layout, blocks, *again, blocks, tokens);
  if (plan.ok()) {
    for (int layer : plan->Layers()) (void)plan->LayerRanges(layer);
  }
  return 0;
}
