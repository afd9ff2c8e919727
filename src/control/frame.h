// Control-channel framing: a 4-byte big-endian payload length, then one serialized Envelope.
#ifndef KVWIRE_CONTROL_FRAME_H_
#define KVWIRE_CONTROL_FRAME_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "proto/kvwire.pb.h"

namespace kvwire::control {

inline constexpr size_t kFrameHeaderBytes = 4;

// Serializes `envelope` into one frame. Fails when the envelope has no body or its payload
// exceeds `max_frame_bytes`.
absl::StatusOr<std::string> EncodeFrame(const pb::Envelope& envelope, uint32_t max_frame_bytes);

// Reassembles frames from a byte stream fed in arbitrary pieces. Not thread-safe.
//
// The first error is sticky: a stream that went wrong once cannot be resynchronised, so every
// later Feed returns the same error. Envelopes decoded before the bad frame stay poppable.
class FrameDecoder {
 public:
  explicit FrameDecoder(uint32_t max_frame_bytes) : max_frame_bytes_(max_frame_bytes) {}

  // Appends bytes and decodes every frame they complete. A length above the limit is
  // rejected as soon as its header is complete, before the payload is buffered.
  absl::Status Feed(absl::string_view bytes);
  absl::Status Feed(const void* data, size_t size) {
    return Feed(absl::string_view(static_cast<const char*>(data), size));
  }

  // Moves the oldest decoded envelope into `*out`; false when none is ready.
  bool Next(pb::Envelope* out);
  bool has_pending() const { return !ready_.empty(); }

  // Call at end of stream: fails if it ended inside a frame (or after an error).
  absl::Status Finish() const;

  // The sticky error, OK while the stream is healthy.
  const absl::Status& status() const { return error_; }

  // Bytes of an incomplete frame held back.
  size_t buffered_bytes() const { return buffer_.size(); }
  uint32_t max_frame_bytes() const { return max_frame_bytes_; }
  // Changes the limit for frames not yet decoded (the handshake reads with a small one).
  void set_max_frame_bytes(uint32_t max_frame_bytes) { max_frame_bytes_ = max_frame_bytes; }

 private:
  absl::Status DecodeBuffered();

  uint32_t max_frame_bytes_;
  std::string buffer_;  // the start of one incomplete frame
  std::deque<pb::Envelope> ready_;
  absl::Status error_;
};

}  // namespace kvwire::control

#endif  // KVWIRE_CONTROL_FRAME_H_
