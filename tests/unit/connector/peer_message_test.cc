// The per-layer message the prefill builds without a json object must be the bytes the json
// writer makes, and must parse back to what it says.
#include "src/connector/peer_message.h"

#include <optional>
#include <random>
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

// The layer reader without a document says what the JSON reader says, or leaves the message
// to it: written ids and layers, near misses of the written form, and random corruptions of it.
void ExpectSameAsJson(const std::string& payload) {
  const std::optional<PeerMessage> fast = ParseLayerMessageAsWritten(payload);
  const absl::StatusOr<PeerMessage> json = ParsePeerMessageAsJson(payload);
  const absl::StatusOr<PeerMessage> both = ParsePeerMessage(payload);
  ASSERT_EQ(both.ok(), json.ok()) << payload;
  if (!json.ok()) {
    EXPECT_FALSE(fast.has_value()) << payload;
    EXPECT_EQ(both.status(), json.status()) << payload;
    return;
  }
  for (const PeerMessage* m : {fast.has_value() ? &*fast : &*json, &*both}) {
    EXPECT_EQ(m->type, json->type) << payload;
    EXPECT_EQ(m->name, json->name) << payload;
    EXPECT_EQ(m->transfer_id, json->transfer_id) << payload;
    EXPECT_EQ(m->layer, json->layer) << payload;
  }
}

TEST(LayerMessagePayloadTest, TheReaderWithoutADocumentAgreesWithTheJsonReader) {
  const std::string id(32, 'a');
  const std::string written = LayerMessagePayload(DumpJson(nlohmann::json(id)), 17);
  ASSERT_TRUE(ParseLayerMessageAsWritten(written).has_value()) << "the written form is read fast";
  const std::string head = R"({"layer":)", middle = R"(,"t":"layer","transfer_id":")";
  for (const std::string& layer : {"0", "7", "1073741824", "1073741825", "07", "-1", "1e2", "1.0",
                                   "9999999999", "99999999999", "", " 3"}) {
    for (const std::string& tid :
         {id, std::string(256, 'x'), std::string(257, 'x'), std::string(""), std::string("a b~"),
          std::string("a\"b"), std::string("a\\b"), std::string("\xc3\xa9"), std::string("a\x7f"),
          std::string("a\tb")}) {
      ExpectSameAsJson(head + layer + middle + tid + R"("})");
    }
  }
  for (const std::string& near :
       {written + " ", " " + written, written.substr(0, written.size() - 1),
        absl::StrCat(R"({"layer":3,"t":"layer","transfer_id":"x","more":1})"),
        absl::StrCat(R"({"layer":3, "t":"layer","transfer_id":"x"})"),
        absl::StrCat(R"({"layer":3,"t":"done","transfer_id":"x"})"),
        absl::StrCat(R"({"layer":3,"t":"layer","transfer_id":"x"}})")}) {
    ExpectSameAsJson(near);
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::string p = written;
    for (int k = 1 + static_cast<int>(rng() % 3); k > 0; --k) {
      const size_t at = rng() % p.size();
      switch (rng() % 3) {
        case 0:
          p[at] = static_cast<char>(rng() % 256);
          break;
        case 1:
          p.erase(at, 1);
          break;
        default:
          p.insert(at, 1, "0123456789\"{}:, \\x"[rng() % 18]);
          break;
      }
      if (p.empty()) p = "{";
    }
    ExpectSameAsJson(p);
    if (HasFatalFailure()) return;
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
