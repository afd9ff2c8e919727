// The per-layer message the prefill builds without a json object must be the bytes the json
// writer makes, and must parse back to what it says.
#include "src/connector/peer_message.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

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

// A release may say how many bytes the reader READ under its grant: optional (an older peer
// sends none), an unsigned integer, at most kMaxReadBytes; anything else closes the sender.
TEST(ReleaseMessageTest, ReadBytesIsOptionalTypedAndBounded) {
  absl::StatusOr<PeerMessage> old =
      ParsePeerMessage(R"({"t":"release","transfer_id":"x","ok":true})");
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_FALSE(old->read_bytes.has_value());
  for (uint64_t n : {uint64_t{0}, uint64_t{4096}, kMaxReadBytes}) {
    absl::StatusOr<PeerMessage> m = ParsePeerMessage(
        DumpJson(nlohmann::json{{"t", "release"}, {"transfer_id", "x"}, {"read_bytes", n}}));
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(m->read_bytes.has_value());
    EXPECT_EQ(*m->read_bytes, n);
  }
  for (const char* bad :
       {R"("read_bytes":-1)", R"("read_bytes":"4096")", R"("read_bytes":1.5)",
        R"("read_bytes":1125899906842625)", R"("read_bytes":[1])", R"("read_bytes":true)"}) {
    absl::StatusOr<PeerMessage> m =
        ParsePeerMessage(absl::StrCat(R"({"t":"release","transfer_id":"x",)", bad, "}"));
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_NE(m.status().message().find("read_bytes"), std::string::npos) << m.status();
    EXPECT_NE(m.status().message().find("release"), std::string::npos) << m.status();
  }
  // null reads as absent, as for every optional field.
  absl::StatusOr<PeerMessage> null_count =
      ParsePeerMessage(R"({"t":"release","transfer_id":"x","read_bytes":null})");
  ASSERT_TRUE(null_count.ok()) << null_count.status();
  EXPECT_FALSE(null_count->read_bytes.has_value());
}

}  // namespace
}  // namespace kvwire::connector_internal
