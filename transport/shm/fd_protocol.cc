#include "transport/shm/fd_protocol.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvwire::transport::shm {
namespace {

constexpr uint32_t kRequestMagic = 0x4b575351;  // "KWSQ"
constexpr uint32_t kReplyMagic = 0x4b575352;    // "KWSR"

class Writer {
 public:
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  void PutBytes(absl::string_view bytes) {
    Put(static_cast<uint32_t>(bytes.size()));
    out_.append(bytes.data(), bytes.size());
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  template <typename T>
  bool Get(T* value) {
    if (in_.size() < sizeof(T)) return false;
    std::memcpy(value, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetBytes(size_t max, std::string* bytes) {
    uint32_t size = 0;
    if (!Get(&size) || size > max || in_.size() < size) return false;
    bytes->assign(in_.data(), size);
    in_.remove_prefix(size);
    return true;
  }
  bool done() const { return in_.empty(); }

 private:
  absl::string_view in_;
};

}  // namespace

std::string EncodeRequest(const FdRequest& request) {
  Writer writer;
  writer.Put(kRequestMagic);
  writer.Put(static_cast<uint8_t>(request.kind));
  writer.Put(request.region);
  writer.PutBytes(request.token);
  return writer.Take();
}

absl::StatusOr<FdRequest> DecodeRequest(absl::string_view bytes) {
  Reader reader(bytes);
  uint32_t magic = 0;
  uint8_t kind = 0;
  FdRequest request;
  if (!reader.Get(&magic) || magic != kRequestMagic) {
    return absl::InvalidArgumentError("shm fd request: bad magic");
  }
  if (!reader.Get(&kind) || !reader.Get(&request.region) ||
      !reader.GetBytes(kMaxTokenBytes, &request.token) || !reader.done()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm fd request: malformed (", bytes.size(), " bytes)"));
  }
  if (kind != static_cast<uint8_t>(FdRequestKind::kHello) &&
      kind != static_cast<uint8_t>(FdRequestKind::kFetch)) {
    return absl::InvalidArgumentError(absl::StrCat("shm fd request: unknown kind ", kind));
  }
  request.kind = static_cast<FdRequestKind>(kind);
  return request;
}

std::string EncodeReply(const FdReply& reply) {
  Writer writer;
  writer.Put(kReplyMagic);
  writer.Put(static_cast<uint32_t>(reply.code));
  writer.Put(reply.region);
  writer.Put(reply.memfd_offset);
  writer.Put(reply.length);
  writer.Put(reply.access);
  writer.Put(reply.epoch_slot);
  writer.Put(reply.epoch);
  // Leave room for the fixed fields so that the reply always fits one message.
  writer.PutBytes(absl::string_view(reply.message).substr(0, kMaxFdMessageBytes / 2));
  return writer.Take();
}

absl::StatusOr<FdReply> DecodeReply(absl::string_view bytes) {
  Reader reader(bytes);
  uint32_t magic = 0;
  uint32_t code = 0;
  FdReply reply;
  if (!reader.Get(&magic) || magic != kReplyMagic) {
    return absl::InternalError("shm fd reply: bad magic");
  }
  if (!reader.Get(&code) || !reader.Get(&reply.region) || !reader.Get(&reply.memfd_offset) ||
      !reader.Get(&reply.length) || !reader.Get(&reply.access) || !reader.Get(&reply.epoch_slot) ||
      !reader.Get(&reply.epoch) || !reader.GetBytes(kMaxFdMessageBytes, &reply.message) ||
      !reader.done()) {
    return absl::InternalError(absl::StrCat("shm fd reply: malformed (", bytes.size(), " bytes)"));
  }
  // absl::StatusCode has 17 values; anything else from the peer is reported as unknown.
  reply.code = code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return reply;
}

}  // namespace kvwire::transport::shm
