#include "src/control/frame.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvwire::control {
namespace {

using ::testing::HasSubstr;

pb::Envelope MakeNotify(uint64_t id, const std::string& payload) {
  pb::Envelope envelope;
  envelope.mutable_notify()->set_transfer_id(id);
  envelope.mutable_notify()->set_payload(payload);
  return envelope;
}

std::string Header(uint32_t length) {
  std::string header(4, '\0');
  header[0] = static_cast<char>(length >> 24);
  header[1] = static_cast<char>(length >> 16);
  header[2] = static_cast<char>(length >> 8);
  header[3] = static_cast<char>(length);
  return header;
}

TEST(FrameTest, RoundTrip) {
  const pb::Envelope sent = MakeNotify(7, "hello");
  absl::StatusOr<std::string> frame = EncodeFrame(sent, 1024);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->size(), kFrameHeaderBytes + sent.ByteSizeLong());
  EXPECT_EQ(frame->substr(0, 4), Header(static_cast<uint32_t>(sent.ByteSizeLong())));

  FrameDecoder decoder(1024);
  ASSERT_TRUE(decoder.Feed(*frame).ok());
  pb::Envelope received;
  ASSERT_TRUE(decoder.Next(&received));
  EXPECT_EQ(received.SerializeAsString(), sent.SerializeAsString());
  EXPECT_FALSE(decoder.Next(&received));
  EXPECT_TRUE(decoder.Finish().ok());
}

TEST(FrameTest, SplitFeedsByteByByte) {
  std::string stream;
  for (uint64_t i = 0; i < 3; ++i) {
    absl::StatusOr<std::string> frame = EncodeFrame(MakeNotify(i, std::string(i * 100, 'x')), 1024);
    ASSERT_TRUE(frame.ok()) << frame.status();
    stream += *frame;
  }
  FrameDecoder decoder(1024);
  std::vector<uint64_t> ids;
  pb::Envelope envelope;
  for (char byte : stream) {
    ASSERT_TRUE(decoder.Feed(std::string(1, byte)).ok());
    while (decoder.Next(&envelope)) ids.push_back(envelope.notify().transfer_id());
  }
  EXPECT_EQ(ids, (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_EQ(decoder.buffered_bytes(), 0u);
  EXPECT_TRUE(decoder.Finish().ok());
}

TEST(FrameTest, OversizedLengthRejectedBeforeBuffering) {
  FrameDecoder decoder(1000);
  absl::Status status = decoder.Feed(Header(1001));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("1001 bytes"));
  EXPECT_THAT(status.message(), HasSubstr("limit of 1000 bytes"));
  EXPECT_EQ(decoder.buffered_bytes(), 0u);
  // The stream cannot be resynchronised: the error sticks.
  EXPECT_EQ(decoder.Feed(std::string(10, 'a')).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(decoder.Finish().code(), absl::StatusCode::kResourceExhausted);
}

TEST(FrameTest, EncodeRejectsOversizedMessage) {
  const pb::Envelope big = MakeNotify(1, std::string(2000, 'x'));
  absl::StatusOr<std::string> frame = EncodeFrame(big, 1000);
  EXPECT_EQ(frame.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(frame.status().message(), HasSubstr(std::to_string(big.ByteSizeLong())));
  EXPECT_THAT(frame.status().message(), HasSubstr("1000 bytes"));
}

TEST(FrameTest, EncodeRejectsEmptyEnvelope) {
  EXPECT_EQ(EncodeFrame(pb::Envelope(), 1000).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FrameTest, MaxSizeBoundary) {
  constexpr uint32_t kMax = 4096;
  // Find a payload size whose envelope is exactly kMax bytes.
  pb::Envelope exact;
  for (size_t payload = kMax - 32; payload < kMax; ++payload) {
    exact = MakeNotify(1, std::string(payload, 'p'));
    if (exact.ByteSizeLong() == kMax) break;
  }
  ASSERT_EQ(exact.ByteSizeLong(), kMax);

  absl::StatusOr<std::string> frame = EncodeFrame(exact, kMax);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(EncodeFrame(exact, kMax - 1).status().code(), absl::StatusCode::kResourceExhausted);

  FrameDecoder at_limit(kMax);
  ASSERT_TRUE(at_limit.Feed(*frame).ok());
  pb::Envelope received;
  EXPECT_TRUE(at_limit.Next(&received));

  FrameDecoder below_limit(kMax - 1);
  EXPECT_EQ(below_limit.Feed(*frame).code(), absl::StatusCode::kResourceExhausted);
}

TEST(FrameTest, ZeroLengthIsGarbage) {
  FrameDecoder decoder(1000);
  absl::Status status = decoder.Feed(Header(0));
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr("zero-length"));
}

TEST(FrameTest, UnparseablePayloadIsGarbage) {
  FrameDecoder decoder(1000);
  absl::Status status = decoder.Feed(Header(5) + std::string(5, '\xff'));
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr("5 bytes"));
}

TEST(FrameTest, PayloadWithoutKnownMessageIsGarbage) {
  // Field 100, varint 1: valid protobuf, but no Envelope body.
  const std::string payload = "\xa0\x06\x01";
  FrameDecoder decoder(1000);
  EXPECT_EQ(decoder.Feed(Header(3) + payload).code(), absl::StatusCode::kDataLoss);
}

TEST(FrameTest, FramesBeforeGarbageAreKept) {
  absl::StatusOr<std::string> frame = EncodeFrame(MakeNotify(9, "ok"), 1000);
  ASSERT_TRUE(frame.ok());
  FrameDecoder decoder(1000);
  EXPECT_FALSE(decoder.Feed(*frame + Header(0)).ok());
  pb::Envelope received;
  ASSERT_TRUE(decoder.Next(&received));
  EXPECT_EQ(received.notify().transfer_id(), 9u);
}

TEST(FrameTest, TruncatedAtEof) {
  absl::StatusOr<std::string> frame = EncodeFrame(MakeNotify(1, std::string(50, 'x')), 1000);
  ASSERT_TRUE(frame.ok());
  const uint32_t payload = static_cast<uint32_t>(frame->size() - kFrameHeaderBytes);

  FrameDecoder mid_payload(1000);
  ASSERT_TRUE(mid_payload.Feed(frame->substr(0, 14)).ok());
  absl::Status status = mid_payload.Finish();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr("got 10 of " + std::to_string(payload)));

  FrameDecoder mid_header(1000);
  ASSERT_TRUE(mid_header.Feed(frame->substr(0, 2)).ok());
  status = mid_header.Finish();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr("header (2 of 4 bytes)"));
}

}  // namespace
}  // namespace kvwire::control
