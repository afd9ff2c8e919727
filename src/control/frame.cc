#include "src/control/frame.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvwire::control {
namespace {

uint32_t ReadBigEndian32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

void AppendBigEndian32(uint32_t value, std::string* out) {
  out->push_back(static_cast<char>((value >> 24) & 0xff));
  out->push_back(static_cast<char>((value >> 16) & 0xff));
  out->push_back(static_cast<char>((value >> 8) & 0xff));
  out->push_back(static_cast<char>(value & 0xff));
}

}  // namespace

absl::StatusOr<std::string> EncodeFrame(const pb::Envelope& envelope, uint32_t max_frame_bytes) {
  // An empty body serializes to zero bytes, which the decoder rejects as garbage.
  if (envelope.body_case() == pb::Envelope::BODY_NOT_SET) {
    return absl::InvalidArgumentError("cannot send an Envelope with no message set");
  }
  const size_t size = envelope.ByteSizeLong();
  if (size > max_frame_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("message of ", size,
                                                     " bytes exceeds the maximum frame size of ",
                                                     max_frame_bytes, " bytes"));
  }
  std::string frame;
  frame.reserve(kFrameHeaderBytes + size);
  AppendBigEndian32(static_cast<uint32_t>(size), &frame);
  frame.resize(kFrameHeaderBytes + size);
  if (!envelope.SerializeWithCachedSizesToArray(
          reinterpret_cast<uint8_t*>(frame.data() + kFrameHeaderBytes))) {
    return absl::InternalError("protobuf serialization of an Envelope failed");
  }
  return frame;
}

absl::Status FrameDecoder::Feed(absl::string_view bytes) {
  if (!error_.ok()) return error_;
  if (bytes.empty()) return absl::OkStatus();
  buffer_.append(bytes.data(), bytes.size());
  error_ = DecodeBuffered();
  return error_;
}

absl::Status FrameDecoder::DecodeBuffered() {
  size_t pos = 0;
  absl::Status status;
  while (buffer_.size() - pos >= kFrameHeaderBytes) {
    const uint32_t length = ReadBigEndian32(buffer_.data() + pos);
    if (length == 0) {
      status = absl::DataLossError("received a frame with a zero-length payload (garbage)");
      break;
    }
    if (length > max_frame_bytes_) {
      status = absl::ResourceExhaustedError(absl::StrCat("received a frame of ", length,
                                                         " bytes, above the limit of ",
                                                         max_frame_bytes_, " bytes"));
      break;
    }
    if (buffer_.size() - pos - kFrameHeaderBytes < length) break;
    pb::Envelope envelope;
    if (!envelope.ParseFromArray(buffer_.data() + pos + kFrameHeaderBytes,
                                 static_cast<int>(length))) {
      status = absl::DataLossError(
          absl::StrCat("received a frame of ", length, " bytes that is not a valid Envelope"));
      break;
    }
    // Bytes that happen to parse but carry no known message are garbage too.
    if (envelope.body_case() == pb::Envelope::BODY_NOT_SET) {
      status = absl::DataLossError(
          absl::StrCat("received a frame of ", length, " bytes holding no known message"));
      break;
    }
    ready_.push_back(std::move(envelope));
    pos += kFrameHeaderBytes + length;
  }
  if (!status.ok()) {
    buffer_.clear();
    return status;
  }
  buffer_.erase(0, pos);
  return absl::OkStatus();
}

bool FrameDecoder::Next(pb::Envelope* out) {
  if (ready_.empty()) return false;
  *out = std::move(ready_.front());
  ready_.pop_front();
  return true;
}

absl::Status FrameDecoder::Finish() const {
  if (!error_.ok()) return error_;
  if (buffer_.empty()) return absl::OkStatus();
  if (buffer_.size() < kFrameHeaderBytes) {
    return absl::DataLossError(absl::StrCat("stream ended inside a frame header (", buffer_.size(),
                                            " of ", kFrameHeaderBytes, " bytes)"));
  }
  const uint32_t length = ReadBigEndian32(buffer_.data());
  return absl::DataLossError(absl::StrCat("stream ended inside a frame: got ",
                                          buffer_.size() - kFrameHeaderBytes, " of ", length,
                                          " payload bytes"));
}

}  // namespace kvwire::control
