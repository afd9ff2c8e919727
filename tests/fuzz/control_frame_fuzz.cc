// Control-channel framing (src/control/frame.cc): what every byte a peer sends on the control
// port goes through first, before and after the handshake. The first input byte picks the
// size of the pieces the stream is fed in (so frame boundaries fall anywhere); every envelope
// that decodes must encode and decode again to the same message.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "google/protobuf/util/message_differencer.h"

#include "src/control/frame.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr uint32_t kMaxFrameBytes = 1 << 16;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvwire::control::FrameDecoder;
  if (size == 0) return 0;
  const size_t piece = (data[0] % 32) + 1;
  const std::string stream(reinterpret_cast<const char*>(data + 1), size - 1);

  FrameDecoder decoder(kMaxFrameBytes);
  kvwire::pb::Envelope envelope;
  for (size_t at = 0; at < stream.size(); at += piece) {
    const absl::Status fed = decoder.Feed(stream.substr(at, piece));
    // The error is sticky: once failed, every later Feed returns it.
    KVWIRE_FUZZ_CHECK(fed.ok() || decoder.status() == fed);
    while (decoder.Next(&envelope)) {
      KVWIRE_FUZZ_CHECK(envelope.body_case() != kvwire::pb::Envelope::BODY_NOT_SET);
      absl::StatusOr<std::string> frame = kvwire::control::EncodeFrame(envelope, kMaxFrameBytes);
      // Re-serialising may differ in size from what was received (overlong varints, repeated
      // fields merged), so a frame over the limit is no failure of the decoder.
      if (!frame.ok()) {
        KVWIRE_FUZZ_CHECK(frame.status().code() == absl::StatusCode::kResourceExhausted);
        continue;
      }
      FrameDecoder again(kMaxFrameBytes);
      KVWIRE_FUZZ_CHECK(again.Feed(*frame).ok());
      kvwire::pb::Envelope decoded;
      KVWIRE_FUZZ_CHECK(again.Next(&decoded));
      // Field by field: a map's serialised order is not fixed.
      KVWIRE_FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(decoded, envelope));
      KVWIRE_FUZZ_CHECK(again.Finish().ok());
    }
  }
  (void)decoder.Finish();
  KVWIRE_FUZZ_CHECK(decoder.buffered_bytes() <=
                    kvwire::control::kFrameHeaderBytes + kMaxFrameBytes);
  return 0;
}
