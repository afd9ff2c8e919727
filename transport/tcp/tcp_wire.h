// Wire protocol of the tcp transport, version 2 (2 added the op's read grant). Every integer is
// little-endian, every header has a fixed size, and every variable-length field is capped.
// End-to-end checksums use fields version 2 had reserved (zero, and checked to be): a target
// built before them refuses a checksummed op with "bad flags", never ignores the checksum.
//
// Setup, once per data connection (one connection per lane):
//
//   dialer -> target  Hello, 16 B:
//     0 u32 magic 0x4857564B ("KVWH")    4 u16 version (2)    6 u16 reserved (0)
//     8 u32 token_len (<= kMaxTokenBytes) 12 u32 lane (informational)
//     then token_len bytes: the session token the target issued in the control handshake
//   target -> dialer  HelloReply, 24 B:
//     0 u32 magic 0x6857564B ("KVWh")    4 u16 version (2)    6 u16 reserved (0)
//     8 u32 code (absl::StatusCode, 0 = accepted)   12 u32 message_len (<= kMaxMessageBytes)
//    16 u64 max_op_bytes the target accepts (0 when refused)
//     then message_len bytes of error text.
//   A refused hello (unknown token, bad magic, wrong version) is answered and then closed.
//
// Ops, initiator -> target, pipelined (no waiting for responses):
//
//   Request header, 64 B:
//     0 u32 magic 0x5157564B ("KVWQ")
//     4 u8  kind: 1 = WRITE, 2 = READ
//     5 u8  flags: bit 0 = count arrivals (WRITE only); bit 1 = checksummed (end-to-end
//           CRC32C, EngineOptions::verify_checksums: a WRITE carries its payload's CRC at
//           offset 12, a READ asks for one in its response); other bits 0
//     6 u16 follow: how many request headers come next in the stream with no payload bytes
//           between them and this op's payload (a read-ahead hint; see below)
//     8 u32 op_index: index of the op within the initiator's Post (for error messages)
//    12 u32 crc: WRITE with bit 1: the CRC32C of the payload, computed by the initiator over
//           its source memory; else 0
//    16 u64 sequence: 0, 1, 2, ... per connection
//    24 u64 transfer_id    32 u64 remote_region    40 u64 remote_offset
//    48 u64 length (<= the target's max_op_bytes)
//    56 u64 grant: the read grant presented (TransferOptions::grant; 0 = none), checked by
//           the target for READs of grant-guarded regions
//   then, for WRITE, `length` payload bytes.
//
// Responses, target -> initiator, one per request, in request order:
//
//   Response header, 32 B:
//     0 u32 magic 0x4157564B ("KVWA")
//     4 u8  kind (echo)    6 u16 follow (as above, for responses)
//     5 u8  flags, only with code 0 (else 0): bit 0 = checksum: offset 12 holds the CRC32C of
//           the READ payload, computed by the target over its source memory; bit 1 = checksum
//           mismatch: the WRITE's payload landed but its CRC32C, computed by the target over
//           the memory it landed in, is the one at offset 12 and differs from the request's
//           (the op failed with DataLoss; the connection stays in sync and open)
//     8 u32 code (absl::StatusCode, 0 = OK)
//    12 u32 message_len (non-OK), or the CRC32C of a flag above (OK), else 0
//    16 u64 sequence (echo; kNoSequence for an error not tied to one request)
//    24 u64 payload_len (READ and OK: the request's length; else 0)
//   then message_len bytes of error text, then payload_len bytes of READ data.
//   A non-OK response is the last thing the target sends on that connection: it closes after.
//
// `follow` lets a receiver read several headers with one recv without ever pulling payload
// bytes into its header buffer: it reads at most follow * header-size bytes past the current
// op's payload, so payloads always land directly in their destination memory. A sender sets
// it to the number of headers it has already committed to send right after this op's payload
// (the run ends at, and includes, the first header that carries payload or message bytes).
#ifndef KVWIRE_TRANSPORT_TCP_TCP_WIRE_H_
#define KVWIRE_TRANSPORT_TCP_TCP_WIRE_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

#include "kvwire/engine.h"

namespace kvwire::transport::tcp_wire {

inline constexpr uint16_t kVersion = 2;

inline constexpr uint32_t kHelloMagic = 0x4857564B;       // "KVWH" as bytes on the wire
inline constexpr uint32_t kHelloReplyMagic = 0x6857564B;  // "KVWh"
inline constexpr uint32_t kRequestMagic = 0x5157564B;     // "KVWQ"
inline constexpr uint32_t kResponseMagic = 0x4157564B;    // "KVWA"

inline constexpr size_t kHelloBytes = 16;
inline constexpr size_t kHelloReplyBytes = 24;
inline constexpr size_t kRequestBytes = 64;
inline constexpr size_t kResponseBytes = 32;

inline constexpr uint32_t kMaxTokenBytes = 4096;
inline constexpr uint32_t kMaxMessageBytes = 4096;
// A receiver never reads ahead more headers than this, whatever `follow` says.
inline constexpr uint16_t kMaxFollow = 64;
inline constexpr uint64_t kNoSequence = UINT64_MAX;

inline constexpr uint8_t kKindWrite = 1;
inline constexpr uint8_t kKindRead = 2;
inline constexpr uint8_t kFlagCountArrivals = 1;
inline constexpr uint8_t kFlagChecksum = 2;
// Response flags (OK responses only).
inline constexpr uint8_t kResponseFlagChecksum = 1;
inline constexpr uint8_t kResponseFlagChecksumMismatch = 2;

inline uint8_t WireKind(OpKind kind) { return kind == OpKind::kWrite ? kKindWrite : kKindRead; }
inline const char* WireKindName(uint8_t kind) {
  return kind == kKindWrite ? "WRITE" : kind == kKindRead ? "READ" : "unknown";
}

// Little-endian stores and loads through memcpy: one mov each on a little-endian host, a
// byte swap more on a big-endian one. (Byte-by-byte shift loops were meant to fold into
// one mov too, but GCC 12 at -O2 kept them as loops: ~300 instructions per op header.)
template <typename T>
inline T ToLittleEndian(T v) {
  if constexpr (std::endian::native == std::endian::big) {
    if constexpr (sizeof(T) == 2) return static_cast<T>(__builtin_bswap16(v));
    if constexpr (sizeof(T) == 4) return static_cast<T>(__builtin_bswap32(v));
    if constexpr (sizeof(T) == 8) return static_cast<T>(__builtin_bswap64(v));
  }
  return v;
}
template <typename T>
inline void StoreLittle(std::byte* p, T v) {
  v = ToLittleEndian(v);
  std::memcpy(p, &v, sizeof(v));
}
template <typename T>
inline T LoadLittle(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return ToLittleEndian(v);  // its own inverse
}
inline void Store16(std::byte* p, uint16_t v) { StoreLittle(p, v); }
inline void Store32(std::byte* p, uint32_t v) { StoreLittle(p, v); }
inline void Store64(std::byte* p, uint64_t v) { StoreLittle(p, v); }
inline uint16_t Load16(const std::byte* p) { return LoadLittle<uint16_t>(p); }
inline uint32_t Load32(const std::byte* p) { return LoadLittle<uint32_t>(p); }
inline uint64_t Load64(const std::byte* p) { return LoadLittle<uint64_t>(p); }

struct Hello {
  uint16_t version = kVersion;
  uint32_t token_len = 0;
  uint32_t lane = 0;
};

inline void EncodeHello(const Hello& h, std::byte* out) {
  Store32(out, kHelloMagic);
  Store16(out + 4, h.version);
  Store16(out + 6, 0);
  Store32(out + 8, h.token_len);
  Store32(out + 12, h.lane);
}

// Checks magic and sizes; the version is returned for the caller to judge.
inline absl::Status DecodeHello(const std::byte* in, Hello* h) {
  const uint32_t magic = Load32(in);
  if (magic != kHelloMagic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bad hello magic 0x%08x (expected 0x%08x)", magic, kHelloMagic));
  }
  h->version = Load16(in + 4);
  h->token_len = Load32(in + 8);
  h->lane = Load32(in + 12);
  if (h->token_len > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hello token length %u exceeds %u", h->token_len, kMaxTokenBytes));
  }
  return absl::OkStatus();
}

struct HelloReply {
  uint16_t version = kVersion;
  uint32_t code = 0;
  uint32_t message_len = 0;
  uint64_t max_op_bytes = 0;
};

inline void EncodeHelloReply(const HelloReply& r, std::byte* out) {
  Store32(out, kHelloReplyMagic);
  Store16(out + 4, r.version);
  Store16(out + 6, 0);
  Store32(out + 8, r.code);
  Store32(out + 12, r.message_len);
  Store64(out + 16, r.max_op_bytes);
}

inline absl::Status DecodeHelloReply(const std::byte* in, HelloReply* r) {
  const uint32_t magic = Load32(in);
  if (magic != kHelloReplyMagic) {
    return absl::DataLossError(absl::StrFormat(
        "bad hello reply magic 0x%08x (expected 0x%08x): not a kvwire tcp endpoint?", magic,
        kHelloReplyMagic));
  }
  r->version = Load16(in + 4);
  r->code = Load32(in + 8);
  r->message_len = Load32(in + 12);
  r->max_op_bytes = Load64(in + 16);
  if (r->message_len > kMaxMessageBytes) {
    return absl::DataLossError(absl::StrFormat("hello reply message length %u exceeds %u",
                                               r->message_len, kMaxMessageBytes));
  }
  return absl::OkStatus();
}

struct RequestHeader {
  uint8_t kind = kKindWrite;
  uint8_t flags = 0;
  uint16_t follow = 0;
  uint32_t op_index = 0;
  uint64_t sequence = 0;
  TransferId transfer_id = 0;
  RegionId region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  GrantId grant = 0;
  uint32_t crc = 0;  // WRITE with kFlagChecksum: the payload's CRC32C
};

inline void EncodeRequest(const RequestHeader& h, std::byte* out) {
  Store32(out, kRequestMagic);
  out[4] = static_cast<std::byte>(h.kind);
  out[5] = static_cast<std::byte>(h.flags);
  Store16(out + 6, h.follow);
  Store32(out + 8, h.op_index);
  Store32(out + 12, h.kind == kKindWrite && (h.flags & kFlagChecksum) != 0 ? h.crc : 0);
  Store64(out + 16, h.sequence);
  Store64(out + 24, h.transfer_id);
  Store64(out + 32, h.region);
  Store64(out + 40, h.offset);
  Store64(out + 48, h.length);
  Store64(out + 56, h.grant);
}

// Rewrites only the `follow` field of an encoded request or response header.
inline void PatchFollow(std::byte* header, uint16_t follow) { Store16(header + 6, follow); }

// Decodes and checks everything that does not need the engine: magic, kind, flags, reserved
// bits, and length against `max_op_bytes`. An error here is a protocol error.
inline absl::Status DecodeRequest(const std::byte* in, uint64_t max_op_bytes, RequestHeader* h) {
  const uint32_t magic = Load32(in);
  if (magic != kRequestMagic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bad op header magic 0x%08x (expected 0x%08x)", magic, kRequestMagic));
  }
  h->kind = static_cast<uint8_t>(in[4]);
  h->flags = static_cast<uint8_t>(in[5]);
  h->follow = Load16(in + 6);
  h->op_index = Load32(in + 8);
  const uint32_t crc_or_reserved = Load32(in + 12);
  h->sequence = Load64(in + 16);
  h->transfer_id = Load64(in + 24);
  h->region = Load64(in + 32);
  h->offset = Load64(in + 40);
  h->length = Load64(in + 48);
  h->grant = Load64(in + 56);
  if (h->kind != kKindWrite && h->kind != kKindRead) {
    return absl::InvalidArgumentError(absl::StrFormat("unknown op kind %u", h->kind));
  }
  const uint8_t allowed_flags =
      h->kind == kKindWrite ? kFlagCountArrivals | kFlagChecksum : kFlagChecksum;
  const bool carries_crc = h->kind == kKindWrite && (h->flags & kFlagChecksum) != 0;
  h->crc = carries_crc ? crc_or_reserved : 0;
  const uint32_t reserved = carries_crc ? 0 : crc_or_reserved;
  if ((h->flags & ~allowed_flags) != 0 || reserved != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bad flags 0x%02x / reserved 0x%08x in %s header", h->flags, reserved,
                        WireKindName(h->kind)));
  }
  if (h->length > max_op_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("op %u of transfer %u: length %u exceeds max_op_bytes %u", h->op_index,
                        h->transfer_id, h->length, max_op_bytes));
  }
  return absl::OkStatus();
}

struct ResponseHeader {
  uint8_t kind = kKindWrite;
  uint8_t flags = 0;  // kResponseFlag*, with code 0 only
  uint16_t follow = 0;
  uint32_t code = 0;
  uint32_t message_len = 0;
  uint64_t sequence = 0;
  uint64_t payload_len = 0;
  uint32_t crc = 0;  // with a kResponseFlag*
};

inline void EncodeResponse(const ResponseHeader& h, std::byte* out) {
  Store32(out, kResponseMagic);
  out[4] = static_cast<std::byte>(h.kind);
  out[5] = static_cast<std::byte>(h.code == 0 ? h.flags : 0);
  Store16(out + 6, h.follow);
  Store32(out + 8, h.code);
  Store32(out + 12, h.code == 0 && h.flags != 0 ? h.crc : h.message_len);
  Store64(out + 16, h.sequence);
  Store64(out + 24, h.payload_len);
}

inline absl::Status DecodeResponse(const std::byte* in, ResponseHeader* h) {
  const uint32_t magic = Load32(in);
  if (magic != kResponseMagic) {
    return absl::DataLossError(
        absl::StrFormat("bad response magic 0x%08x (expected 0x%08x)", magic, kResponseMagic));
  }
  h->kind = static_cast<uint8_t>(in[4]);
  h->flags = static_cast<uint8_t>(in[5]);
  h->follow = Load16(in + 6);
  h->code = Load32(in + 8);
  h->message_len = Load32(in + 12);
  h->crc = 0;
  if (h->flags != 0) {
    const uint8_t allowed =
        h->kind == kKindRead ? kResponseFlagChecksum : kResponseFlagChecksumMismatch;
    if (h->code != 0 || (h->flags & ~allowed) != 0) {
      return absl::DataLossError(absl::StrFormat("bad response flags 0x%02x (code %u, %s)",
                                                 h->flags, h->code, WireKindName(h->kind)));
    }
    h->crc = h->message_len;
    h->message_len = 0;
  }
  h->sequence = Load64(in + 16);
  h->payload_len = Load64(in + 24);
  if (h->message_len > kMaxMessageBytes) {
    return absl::DataLossError(
        absl::StrFormat("response message length %u exceeds %u", h->message_len, kMaxMessageBytes));
  }
  if (h->code != 0 && h->payload_len != 0) {
    return absl::DataLossError("error response carries a payload");
  }
  return absl::OkStatus();
}

// An absl::StatusCode from the wire; unknown values become kUnknown.
inline absl::StatusCode CodeFromWire(uint32_t code) {
  return code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)
             ? static_cast<absl::StatusCode>(code)
             : absl::StatusCode::kUnknown;
}

}  // namespace kvwire::transport::tcp_wire

#endif  // KVWIRE_TRANSPORT_TCP_TCP_WIRE_H_
