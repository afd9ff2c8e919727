#include "src/control/handshake.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "src/control/hmac.h"

namespace kvwire::control {
namespace {

std::string Hex64(uint64_t value) { return absl::StrCat("0x", absl::Hex(value, absl::kZeroPad16)); }

// 64-bit FNV-1a.
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001b3ULL;
uint64_t Fnv1a(uint64_t hash, const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= kFnvPrime;
  }
  return hash;
}
uint64_t Fnv1aLittleEndian(uint64_t hash, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    const unsigned char byte = static_cast<unsigned char>(value >> (8 * i));
    hash = Fnv1a(hash, &byte, 1);
  }
  return hash;
}

}  // namespace

uint64_t CompatibilityHash(uint64_t salt) {
  // The descriptor's text covers every message, field number and type, so builds with
  // different protocol definitions disagree even if kProtocolVersion was not bumped.
  static const uint64_t kProtocolHash = [] {
    const std::string text = pb::Envelope::descriptor()->file()->DebugString();
    uint64_t hash = Fnv1a(kFnvOffset, text.data(), text.size());
    return Fnv1aLittleEndian(hash, kProtocolVersion, 4);
  }();
  return Fnv1aLittleEndian(kProtocolHash, salt, 8);
}

std::string DescribePeer(const pb::Hello& hello, absl::string_view address) {
  if (hello.engine_name().empty()) return std::string(address);
  return absl::StrCat("\"", hello.engine_name(), "\" (", address, ")");
}

const char* MessageName(const pb::Envelope& envelope) {
  switch (envelope.body_case()) {
    case pb::Envelope::kHello:
      return "Hello";
    case pb::Envelope::kHelloAck:
      return "HelloAck";
    case pb::Envelope::kAuthProof:
      return "AuthProof";
    case pb::Envelope::kReject:
      return "Reject";
    case pb::Envelope::kHeartbeat:
      return "Heartbeat";
    case pb::Envelope::kExportRegions:
      return "ExportRegions";
    case pb::Envelope::kRevokeRegions:
      return "RevokeRegions";
    case pb::Envelope::kNotify:
      return "Notify";
    case pb::Envelope::kGoodbye:
      return "Goodbye";
    case pb::Envelope::kWelcome:
      return "Welcome";
    case pb::Envelope::kEngineMessage:
      return "EngineMessage";
    case pb::Envelope::kTransportControl:
      return "TransportControl";
    case pb::Envelope::BODY_NOT_SET:
      break;
  }
  return "empty Envelope";
}

void OwnNonces::Add(const std::string& nonce) {
  MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  while (!order_.empty() &&
         (order_.size() >= kMaxNonces || order_.front().first + kRetention < now)) {
    issued_.erase(order_.front().second);
    order_.pop_front();
  }
  if (issued_.insert(nonce).second) order_.emplace_back(now, nonce);
}

bool OwnNonces::Contains(const std::string& nonce) {
  MutexLock lock(&mu_);
  return issued_.contains(nonce);
}

absl::StatusOr<pb::Hello> PrepareHello(pb::Hello hello, const HandshakeConfig& config) {
  hello.set_protocol_version(config.protocol_version_for_testing);
  hello.set_compat_hash(config.compat_hash);
  hello.set_has_secret(!config.shared_secret.empty());
  hello.clear_auth_nonce();
  // Tokens are added by the handshake itself, and only once it is safe (see control.h).
  hello.clear_session_token();
  if (!config.shared_secret.empty()) {
    absl::StatusOr<std::string> nonce = RandomNonce(kAuthNonceBytes);
    if (!nonce.ok()) return nonce.status();
    if (config.own_nonces != nullptr) config.own_nonces->Add(*nonce);
    hello.set_auth_nonce(*std::move(nonce));
  }
  return hello;
}

absl::Status CheckPeerHello(const pb::Hello& peer, absl::string_view peer_address,
                            const HandshakeConfig& config, HandshakeRoles roles) {
  const std::string who = DescribePeer(peer, peer_address);
  if (peer.protocol_version() != config.protocol_version_for_testing) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol version mismatch: ", roles.local, " speaks ", config.protocol_version_for_testing,
        ", ", roles.peer, " ", who, " speaks ", peer.protocol_version()));
  }
  if (peer.compat_hash() != config.compat_hash) {
    return absl::FailedPreconditionError(absl::StrCat(
        "compatibility hash mismatch: ", roles.local, " has ", Hex64(config.compat_hash), ", ",
        roles.peer, " ", who, " has ", Hex64(peer.compat_hash()),
        " (different kvwire protocol build or compat_salt)"));
  }
  const bool local_secret = !config.shared_secret.empty();
  if (local_secret && !peer.has_secret()) {
    return absl::PermissionDeniedError(absl::StrCat("shared secret required by ", roles.local,
                                                    " but ", roles.peer, " ", who,
                                                    " has none configured"));
  }
  if (!local_secret && peer.has_secret()) {
    return absl::PermissionDeniedError(absl::StrCat(roles.peer, " ", who,
                                                    " sent a secret challenge but ", roles.local,
                                                    " has no shared secret configured"));
  }
  if (local_secret && peer.auth_nonce().size() != kAuthNonceBytes) {
    return absl::InvalidArgumentError(absl::StrCat(roles.peer, " ", who, " sent a ",
                                                   peer.auth_nonce().size(),
                                                   "-byte auth nonce; expected ", kAuthNonceBytes));
  }
  if (local_secret && config.own_nonces != nullptr &&
      config.own_nonces->Contains(peer.auth_nonce())) {
    return absl::PermissionDeniedError(
        absl::StrCat(roles.peer, " ", who,
                     " sent an auth nonce that this engine issued itself: a relay is "
                     "playing this engine's own Hello back to it (reflection), refused"));
  }
  return absl::OkStatus();
}

std::string ListenerProof(absl::string_view secret, absl::string_view dialer_nonce,
                          absl::string_view listener_nonce) {
  return HmacSha256(secret, absl::StrCat("kvwire-listener", dialer_nonce, listener_nonce));
}

std::string DialerProof(absl::string_view secret, absl::string_view listener_nonce,
                        absl::string_view dialer_nonce) {
  return HmacSha256(secret, absl::StrCat("kvwire-dialer", listener_nonce, dialer_nonce));
}

bool ProofMatches(absl::string_view expected, absl::string_view received) {
  return expected.size() == kHmacSha256Bytes && ConstantTimeEquals(expected, received);
}

pb::Envelope MakeReject(const absl::Status& status) {
  pb::Envelope envelope;
  envelope.mutable_reject()->set_code(static_cast<uint32_t>(status.code()));
  envelope.mutable_reject()->set_reason(std::string(status.message()));
  return envelope;
}

absl::Status StatusFromWire(uint32_t code, absl::string_view reason, absl::string_view prefix,
                            absl::StatusCode ok_code) {
  absl::StatusCode status_code = absl::StatusCode::kUnknown;
  if (code == 0) {
    status_code = ok_code;
  } else if (code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    status_code = static_cast<absl::StatusCode>(code);
  }
  return absl::Status(status_code, absl::StrCat(prefix, reason));
}

}  // namespace kvwire::control
