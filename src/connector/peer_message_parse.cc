// Connector-to-connector messages: parsing a peer's payload into a typed, bounded PeerMessage
// (peer_message.h), one parser per message type through a table.
#include <algorithm>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

namespace connector_internal {

namespace {

// hello, hello_ack: the sender's engine, mode, layout and regions.
void ParseHello(JsonFields& f, PeerMessage& m) {
  m.engine_id = f.String("engine_id", 256);
  const std::string mode = f.OptString("mode", "auto", 16);
  if (absl::StatusOr<KvMode> k = ParseKvMode(mode); k.ok()) {
    m.mode = *k;
  } else {
    f.Fail("mode", absl::StrCat("must be read, write or auto, got \"", mode, "\""));
  }
  if (const nlohmann::json* layout = f.Object("layout", /*required=*/true); layout != nullptr) {
    absl::StatusOr<Layout> l = LayoutFromJsonValue(*layout);
    if (l.ok()) {
      m.layout = std::move(*l);
    } else {
      f.Fail("layout", absl::StrCat("is not usable: ", l.status().message()));
    }
  }
  const nlohmann::json* regions = f.Array("regions", /*required=*/true, kMaxRegions);
  for (size_t i = 0; regions != nullptr && i < regions->size() && f.ok(); ++i) {
    const nlohmann::json& r = (*regions)[i];
    const std::string name = absl::StrCat("regions[", i, "]");
    if (!r.is_array() || r.size() != 3) {
      f.Fail(name, "must be [base, length, region id]");
      break;
    }
    RegionSpan span;
    span.base = f.UintValue(r[0], name + "[0]");
    span.length = f.UintValue(r[1], name + "[1]");
    span.id = f.UintValue(r[2], name + "[2]");
    if (f.ok() && span.length > std::numeric_limits<uint64_t>::max() - span.base) {
      f.Fail(name, "ends past the end of the address space");
    }
    m.regions.push_back(span);
  }
}

void ParseHelloErr(JsonFields& f, PeerMessage& m) {
  m.reason = f.OptString("error", "?", kMaxReasonBytes);
}

// Every message about one transfer names it.
void ParseTransferId(JsonFields& f, PeerMessage& m) {
  m.transfer_id = f.String("transfer_id", kMaxTransferIdBytes);
  if (f.ok() && m.transfer_id.empty()) f.Fail("transfer_id", "is empty");
}

void ParseRelease(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.ok = f.OptBool("ok", true);
  m.unread = f.OptBool("unread", false);
  m.reason = f.OptString("reason", "?", kMaxReasonBytes);
  if (f.Has("read_bytes")) m.read_bytes = f.Uint("read_bytes", kMaxReadBytes);
}

void ParseWriteReq(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.blocks = BlocksFromJson(f, "blocks", /*required=*/true);
  m.num_cached = f.OptUint("num_cached", uint64_t{1} << 40, 0);
}

void ParseLayer(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.layer = static_cast<int>(f.Int("layer", 0, 1 << 30));
}

void ParseDone(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  (void)f.OptUint("bytes", std::numeric_limits<uint64_t>::max(), 0);
}

void ParseReadOk(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.grant = f.Uint("grant", std::numeric_limits<uint64_t>::max());
  if (f.ok() && m.grant == 0) f.Fail("grant", "is 0");
}

void ParseFail(JsonFields& f, PeerMessage& m) {
  ParseTransferId(f, m);
  m.unread = f.OptBool("unread", false);
  m.reason = f.OptString("reason", "?", kMaxReasonBytes);
}

// The wire name of each message type and the parser of its fields.
struct MessageFormat {
  const char* name;
  PeerMessage::Type type;
  void (*parse)(JsonFields& f, PeerMessage& m);
};
constexpr MessageFormat kMessageFormats[] = {
    {"hello", PeerMessage::Type::kHello, ParseHello},
    {"hello_ack", PeerMessage::Type::kHelloAck, ParseHello},
    {"hello_err", PeerMessage::Type::kHelloErr, ParseHelloErr},
    {"read_start", PeerMessage::Type::kReadStart, ParseTransferId},
    {"release", PeerMessage::Type::kRelease, ParseRelease},
    {"write_req", PeerMessage::Type::kWriteReq, ParseWriteReq},
    {"layer", PeerMessage::Type::kLayer, ParseLayer},
    {"done", PeerMessage::Type::kDone, ParseDone},
    {"fail", PeerMessage::Type::kFail, ParseFail},
    {"read_ok", PeerMessage::Type::kReadOk, ParseReadOk},
};

// The layer message's fixed bytes around its number and its id (a JSON string), for the
// writer and for the reader of what it writes.
constexpr absl::string_view kLayerHead = R"({"layer":)";
constexpr absl::string_view kLayerMiddle = R"(,"t":"layer","transfer_id":)";

}  // namespace

std::string LayerMessagePayload(absl::string_view transfer_id_json, int layer) {
  return absl::StrCat(kLayerHead, layer, kLayerMiddle, transfer_id_json, "}");
}

std::optional<PeerMessage> ParseLayerMessageAsWritten(absl::string_view payload) {
  if (!absl::ConsumePrefix(&payload, kLayerHead)) return std::nullopt;
  // The layer: a JSON integer ("0" or no leading zero) in [0, 2^30], as ParseLayer takes it.
  size_t digits = 0;
  uint64_t layer = 0;
  while (digits < payload.size() && digits < 10 && payload[digits] >= '0' &&
         payload[digits] <= '9') {
    layer = layer * 10 + static_cast<uint64_t>(payload[digits] - '0');
    ++digits;
  }
  if (digits == 0 || (digits > 1 && payload[0] == '0') || layer > (uint64_t{1} << 30)) {
    return std::nullopt;
  }
  payload.remove_prefix(digits);
  // The id's quotes, around bytes that are the id itself (checked below).
  if (!absl::ConsumePrefix(&payload, kLayerMiddle) || !absl::ConsumePrefix(&payload, "\"") ||
      !absl::ConsumeSuffix(&payload, "\"}")) {
    return std::nullopt;
  }
  // The id: printable ASCII with nothing to unescape, so its bytes are its value.
  if (payload.empty() || payload.size() > kMaxTransferIdBytes) return std::nullopt;
  for (const char c : payload) {
    if (c < 0x20 || c > 0x7e || c == '"' || c == '\\') return std::nullopt;
  }
  PeerMessage m;
  m.type = PeerMessage::Type::kLayer;
  m.name = "layer";
  m.transfer_id = std::string(payload);
  m.layer = static_cast<int>(layer);
  return m;
}

absl::StatusOr<PeerMessage> ParsePeerMessage(const std::string& payload) {
  // Most messages of a write-mode request are its layers': read without building a document.
  if (std::optional<PeerMessage> layer = ParseLayerMessageAsWritten(payload)) {
    return *std::move(layer);
  }
  return ParsePeerMessageAsJson(payload);
}

absl::StatusOr<PeerMessage> ParsePeerMessageAsJson(const std::string& payload) {
  absl::StatusOr<nlohmann::json> j = ParseJsonObject(payload, "connector message");
  if (!j.ok()) return j.status();
  PeerMessage m;
  {
    JsonFields head(*j, "connector message");
    m.name = head.String("t", 32);
    if (!head.ok()) return head.status();
  }
  const MessageFormat* format =
      std::find_if(std::begin(kMessageFormats), std::end(kMessageFormats),
                   [&](const MessageFormat& t) { return m.name == t.name; });
  if (format == std::end(kMessageFormats)) {
    return absl::InvalidArgumentError(
        absl::StrCat("connector message of unknown type '", m.name, "'"));
  }
  m.type = format->type;
  JsonFields f(*j, absl::StrCat("connector message '", m.name, "'"));
  format->parse(f, m);
  if (!f.ok()) return f.status();
  return m;
}

}  // namespace connector_internal

}  // namespace kvwire
