// Connector-to-connector messages as a peer sends them, parsed into a typed, bounded
// PeerMessage before any of it is used (peer_message_parse.cc), and the bounds on what one may
// hold.
#ifndef KVWIRE_CONNECTOR_PEER_MESSAGE_H_
#define KVWIRE_CONNECTOR_PEER_MESSAGE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"

namespace kvwire {
namespace connector_internal {

// A registered memory range (local, or a peer's from its hello).
struct RegionSpan {
  uint64_t base = 0;
  uint64_t length = 0;
  RegionId id = 0;
};

// Bounds on what a peer's connector message may hold.
inline constexpr size_t kMaxTransferIdBytes = 256;
inline constexpr size_t kMaxReasonBytes = 4096;
inline constexpr size_t kMaxRegions = 4096;
// Write requests a prefill keeps for requests its scheduler has not seen yet: per peer, and
// in all. Beyond them a write request is answered with "fail" at once.
inline constexpr size_t kMaxEarlyWritesPerPeer = 1024;
inline constexpr size_t kMaxEarlyWrites = 8192;
// Releases of read-mode transfers not held yet that a prefill remembers (transfer ids).
inline constexpr size_t kMaxEarlyReleases = 8192;
// Engines that may read one prefill rank's hand-off: the decode's tensor-parallel size, from
// its layout, is refused beyond this (each reader holds an engine grant of every page).
inline constexpr int kMaxReaders = 64;
// A release's count of bytes read under a grant: at most 2^50 (a PiB; more is refused).
inline constexpr uint64_t kMaxReadBytes = uint64_t{1} << 50;

// One connector message from a peer, with every field checked (type, range, size) before any
// of it is used.
struct PeerMessage {
  enum class Type {
    kHello,
    kHelloAck,
    kHelloErr,
    kReadStart,
    kRelease,
    kWriteReq,
    kLayer,
    kDone,
    kFail,
    kReadOk
  };
  Type type = Type::kHello;
  std::string name;  // the type as sent ("hello", "release", ...)
  std::string transfer_id;
  // hello, hello_ack
  std::string engine_id;
  KvMode mode = KvMode::kAuto;
  Layout layout;
  std::vector<RegionSpan> regions;
  // release
  bool ok = true;
  // release (optional): the bytes the reader READ under its grant; the holder frees the blocks
  // once its engine served that many (an older peer sends none).
  std::optional<uint64_t> read_bytes;
  // release, fail: the reader will not read this transfer at all (it found the KV in its own
  // prefix cache, or its request ended first): the holder frees the blocks at once and counts
  // the request as released, not failed.
  bool unread = false;
  // release, fail; hello_err's error
  std::string reason;
  // write_req
  BlockTable blocks;
  uint64_t num_cached = 0;
  // layer
  int layer = 0;
  // read_ok: the engine grant the reader presents with its READs (TransferOptions::grant)
  uint64_t grant = 0;
};
// Errors name the message type and the field ("connector message 'release': 'transfer_id'
// must be a string, got 5").
absl::StatusOr<PeerMessage> ParsePeerMessage(const std::string& payload);
// ParsePeerMessage's two readers, for tests that hold them to each other. The first reads a
// "layer" message only in LayerMessagePayload's exact form (no spacing, an id with nothing
// to unescape), without a JSON document; nullopt for anything else, which the second (the
// general JSON reader) then reads, the same way.
std::optional<PeerMessage> ParseLayerMessageAsWritten(absl::string_view payload);
absl::StatusOr<PeerMessage> ParsePeerMessageAsJson(const std::string& payload);

// The "layer" message for `layer` of the transfer whose id, written as a json string, is
// `transfer_id_json`: the bytes DumpJson writes for {"t": "layer", "transfer_id": ...,
// "layer": ...}, built as one string (the prefill sends one per layer of every request).
std::string LayerMessagePayload(absl::string_view transfer_id_json, int layer);

}  // namespace connector_internal
}  // namespace kvwire

#endif  // KVWIRE_CONNECTOR_PEER_MESSAGE_H_
