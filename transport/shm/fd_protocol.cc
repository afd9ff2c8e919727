#include "transport/shm/fd_protocol.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvwire::transport::shm {
namespace {

constexpr uint32_t kRequestMagic = 0x4b575351;  // "KWSQ"
constexpr uint32_t kReplyMagic = 0x4b575352;    // "KWSR"

// Appends to a string the caller owns (cleared first: its capacity is kept).
class Writer {
 public:
  explicit Writer(std::string* out) : out_(*out) { out_.clear(); }
  template <typename T>
  void Put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  void PutBytes(absl::string_view bytes) {
    Put(static_cast<uint32_t>(bytes.size()));
    out_.append(bytes.data(), bytes.size());
  }

 private:
  std::string& out_;
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
  std::string out;
  EncodeRequestTo(request, &out);
  return out;
}

void EncodeRequestTo(const FdRequest& request, std::string* out) {
  Writer writer(out);
  writer.Put(kRequestMagic);
  writer.Put(static_cast<uint8_t>(request.kind));
  writer.Put(request.region);
  writer.PutBytes(request.token);
  if (request.kind == FdRequestKind::kCopy) {
    writer.Put(static_cast<uint8_t>(request.copy_kind));
    writer.Put(request.grant);
    writer.Put(request.slot);
    writer.Put(static_cast<uint32_t>(request.ops.size()));
    for (const CopyOp& op : request.ops) {
      writer.Put(op.region);
      writer.Put(op.offset);
      writer.Put(op.length);
    }
  }
}

absl::StatusOr<FdRequest> DecodeRequest(absl::string_view bytes) {
  FdRequest request;
  if (absl::Status s = DecodeRequestInto(bytes, &request); !s.ok()) return s;
  return request;
}

absl::Status DecodeRequestInto(absl::string_view bytes, FdRequest* out) {
  Reader reader(bytes);
  uint32_t magic = 0;
  uint8_t kind = 0;
  FdRequest& request = *out;
  // Every field is (re)set below or keeps its default: nothing of a previous request stays.
  request.copy_kind = OpKind::kRead;
  request.grant = 0;
  request.slot = 0;
  request.ops.clear();
  if (!reader.Get(&magic) || magic != kRequestMagic) {
    return absl::InvalidArgumentError("shm fd request: bad magic");
  }
  const auto malformed = [&bytes] {
    return absl::InvalidArgumentError(
        absl::StrCat("shm fd request: malformed (", bytes.size(), " bytes)"));
  };
  if (!reader.Get(&kind) || !reader.Get(&request.region) ||
      !reader.GetBytes(kMaxTokenBytes, &request.token)) {
    return malformed();
  }
  if (kind != static_cast<uint8_t>(FdRequestKind::kHello) &&
      kind != static_cast<uint8_t>(FdRequestKind::kFetch) &&
      kind != static_cast<uint8_t>(FdRequestKind::kStaging) &&
      kind != static_cast<uint8_t>(FdRequestKind::kCopy)) {
    return absl::InvalidArgumentError(absl::StrCat("shm fd request: unknown kind ", kind));
  }
  request.kind = static_cast<FdRequestKind>(kind);
  if (request.kind == FdRequestKind::kCopy) {
    uint8_t copy_kind = 0;
    uint32_t count = 0;
    if (!reader.Get(&copy_kind) || !reader.Get(&request.grant) || !reader.Get(&request.slot) ||
        !reader.Get(&count)) {
      return malformed();
    }
    if (copy_kind != static_cast<uint8_t>(OpKind::kRead) &&
        copy_kind != static_cast<uint8_t>(OpKind::kWrite)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shm fd request: unknown copy kind ", copy_kind));
    }
    if (count == 0 || count > kMaxCopyOps) {
      return absl::InvalidArgumentError(
          absl::StrCat("shm fd request: ", count, " copy ops (1 to ", kMaxCopyOps, ")"));
    }
    request.copy_kind = static_cast<OpKind>(copy_kind);
    request.ops.resize(count);
    for (CopyOp& op : request.ops) {
      if (!reader.Get(&op.region) || !reader.Get(&op.offset) || !reader.Get(&op.length)) {
        return malformed();
      }
    }
  }
  if (!reader.done()) return malformed();
  return absl::OkStatus();
}

std::string EncodeReply(const FdReply& reply) {
  std::string out;
  EncodeReplyTo(reply, &out);
  return out;
}

void EncodeReplyTo(const FdReply& reply, std::string* out) {
  Writer writer(out);
  writer.Put(kReplyMagic);
  writer.Put(static_cast<uint32_t>(reply.code));
  writer.Put(reply.region);
  writer.Put(reply.memfd_offset);
  writer.Put(reply.length);
  writer.Put(reply.access);
  writer.Put(reply.epoch_slot);
  writer.Put(reply.epoch);
  writer.Put(reply.flags);
  // Leave room for the fixed fields so that the reply always fits one message.
  writer.PutBytes(absl::string_view(reply.message).substr(0, kMaxFdMessageBytes / 2));
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
      !reader.Get(&reply.epoch) || !reader.Get(&reply.flags) ||
      !reader.GetBytes(kMaxFdMessageBytes, &reply.message) || !reader.done()) {
    return absl::InternalError(absl::StrCat("shm fd reply: malformed (", bytes.size(), " bytes)"));
  }
  // absl::StatusCode has 17 values; anything else from the peer is reported as unknown.
  reply.code = code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return reply;
}

}  // namespace kvwire::transport::shm
