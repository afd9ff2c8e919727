// The per-layer message the prefill builds without a json object must be the bytes the json
// writer makes, and must parse back to what it says.
#include "src/connector/peer_message.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "src/util/json_fields.h"

namespace kvwire::connector_internal {
namespace {

TEST(LayerMessagePayloadTest, IsWhatTheJsonWriterWritesAndParsesBack) {
  for (const std::string tid : {std::string("0123456789abcdef0123456789abcdef"),
                                std::string("odd \"id\" \\ with\tescapes \xc3\xa9")}) {
    for (int layer : {0, 7, 60, 1 << 20}) {
      const std::string payload = LayerMessagePayload(DumpJson(nlohmann::json(tid)), layer);
      EXPECT_EQ(payload,
                DumpJson(nlohmann::json{{"t", "layer"}, {"transfer_id", tid}, {"layer", layer}}));
      absl::StatusOr<PeerMessage> m = ParsePeerMessage(payload);
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_EQ(m->type, PeerMessage::Type::kLayer);
      EXPECT_EQ(m->transfer_id, tid);
      EXPECT_EQ(m->layer, layer);
    }
  }
}

}  // namespace
}  // namespace kvwire::connector_internal
