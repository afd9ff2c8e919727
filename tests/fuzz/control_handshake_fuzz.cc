// The control-channel handshake (src/control/handshake.cc) as the listener
// (inbound_handshake.cc InboundHandshake) and the dialer (dialer.cc DialBlocking) run it, without
// the sockets: the input is what the peer sends, decoded by the real FrameDecoder, and each
// envelope goes through the same checks, in the same order, as the socket code calls them.
//
// Input: byte 0 picks the side and its config (bit 0: dialer instead of listener; bit 1: a
// shared secret; bit 2: a compat salt the peer cannot guess), the rest is the peer's stream.
//
// Properties: no input crashes; every refusal has a Reject that fits a frame or is dropped;
// and, the point of the secret, a side with a secret never completes a handshake, because the
// peer (the fuzzer) cannot know the random secret.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

#include "src/control/control.h"
#include "src/control/frame.h"
#include "src/control/handshake.h"
#include "src/control/hmac.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvwire::control {
namespace {

constexpr char kPeerAddress[] = "192.0.2.1:4000";

// What the side under test sends on a refusal (listener Fail / dialer SendRejectBestEffort):
// a Reject that encodes, or nothing.
void Refuse(const absl::Status& status, const HandshakeConfig& config) {
  KVWIRE_FUZZ_CHECK(!status.ok());
  absl::StatusOr<std::string> frame = EncodeFrame(MakeReject(status), config.max_frame_bytes);
  if (!frame.ok()) return;  // the socket code closes without a Reject
  FrameDecoder decoder(config.max_frame_bytes);
  pb::Envelope reject;
  KVWIRE_FUZZ_CHECK(decoder.Feed(*frame).ok() && decoder.Next(&reject) && reject.has_reject());
  const absl::Status back = StatusFromWire(reject.reject().code(), reject.reject().reason(), "");
  KVWIRE_FUZZ_CHECK(back.code() == status.code());
}

// InboundHandshake: Hello -> HelloAck [-> AuthProof]. Returns true when it succeeded.
bool RunListener(FrameDecoder& decoder, const absl::Status& fed, const HandshakeConfig& config) {
  enum class Phase { kAwaitHello, kAwaitProof } phase = Phase::kAwaitHello;
  pb::Hello dialer_hello, listener_hello;
  pb::Envelope envelope;
  while (decoder.Next(&envelope)) {
    (void)MessageName(envelope);
    if (envelope.has_reject()) {
      (void)StatusFromWire(envelope.reject().code(), envelope.reject().reason(),
                           "rejected: ", absl::StatusCode::kPermissionDenied);
      return false;
    }
    if (phase == Phase::kAwaitHello && envelope.has_hello()) {
      dialer_hello = envelope.hello();
      (void)DescribePeer(dialer_hello, kPeerAddress);
      absl::Status checked = CheckPeerHello(dialer_hello, kPeerAddress, config, kListenerRoles);
      if (!checked.ok()) {
        Refuse(checked, config);
        return false;
      }
      absl::StatusOr<pb::Hello> prepared = PrepareHello(pb::Hello(), config);
      KVWIRE_FUZZ_CHECK(prepared.ok());
      listener_hello = *prepared;
      pb::Envelope ack;
      *ack.mutable_hello_ack()->mutable_hello() = listener_hello;
      if (config.shared_secret.empty()) return true;
      ack.mutable_hello_ack()->set_auth_proof(ListenerProof(
          config.shared_secret, dialer_hello.auth_nonce(), listener_hello.auth_nonce()));
      KVWIRE_FUZZ_CHECK(EncodeFrame(ack, config.max_frame_bytes).ok());
      phase = Phase::kAwaitProof;
    } else if (phase == Phase::kAwaitProof && envelope.has_auth_proof()) {
      const std::string expected =
          DialerProof(config.shared_secret, listener_hello.auth_nonce(), dialer_hello.auth_nonce());
      if (!ProofMatches(expected, envelope.auth_proof().proof())) {
        Refuse(absl::PermissionDeniedError(absl::StrCat("shared secret mismatch: dialer ",
                                                        DescribePeer(dialer_hello, kPeerAddress),
                                                        " failed the HMAC challenge")),
               config);
        return false;
      }
      return true;
    } else {
      Refuse(absl::InvalidArgumentError(absl::StrCat("dialer sent ", MessageName(envelope))),
             config);
      return false;
    }
  }
  if (!fed.ok()) Refuse(fed, config);
  return false;
}

// DialBlocking after its Hello went out: HelloAck (or Reject) -> [AuthProof].
bool RunDialer(FrameDecoder& decoder, const HandshakeConfig& config) {
  absl::StatusOr<pb::Hello> hello = PrepareHello(pb::Hello(), config);
  KVWIRE_FUZZ_CHECK(hello.ok());
  pb::Envelope answer;
  if (!decoder.Next(&answer)) return false;
  if (answer.has_reject()) {
    (void)StatusFromWire(answer.reject().code(), answer.reject().reason(),
                         "rejected by peer: ", absl::StatusCode::kPermissionDenied);
    return false;
  }
  if (!answer.has_hello_ack()) {
    Refuse(absl::InvalidArgumentError(absl::StrCat("answered Hello with ", MessageName(answer))),
           config);
    return false;
  }
  const pb::HelloAck& ack = answer.hello_ack();
  (void)DescribePeer(ack.hello(), kPeerAddress);
  if (absl::Status s = CheckPeerHello(ack.hello(), kPeerAddress, config, kDialerRoles); !s.ok()) {
    Refuse(s, config);
    return false;
  }
  if (!config.shared_secret.empty()) {
    const std::string expected =
        ListenerProof(config.shared_secret, hello->auth_nonce(), ack.hello().auth_nonce());
    if (!ProofMatches(expected, ack.auth_proof())) {
      Refuse(absl::PermissionDeniedError("shared secret mismatch"), config);
      return false;
    }
  }
  // After the handshake the stream belongs to the Connection: what follows is decoded there.
  pb::Envelope after;
  while (decoder.Next(&after)) {
    if (after.has_goodbye()) {
      (void)StatusFromWire(after.goodbye().code(), after.goodbye().reason(), "goodbye: ");
    } else if (after.has_reject()) {
      (void)StatusFromWire(after.reject().code(), after.reject().reason(),
                           "rejected: ", absl::StatusCode::kPermissionDenied);
    }
  }
  return true;
}

}  // namespace
}  // namespace kvwire::control

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::control;
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  HandshakeConfig config;
  config.max_frame_bytes = 1 << 16;
  config.compat_hash = CompatibilityHash((flags & 4) != 0 ? 0x5eed5a17c0ffee11ull : 0);
  if ((flags & 2) != 0) {
    // Random per process, as an operator's secret is unknown to an attacker.
    static const std::string secret = *RandomNonce(32);
    config.shared_secret = secret;
  }
  FrameDecoder decoder(config.max_frame_bytes);
  const absl::Status fed =
      decoder.Feed(absl::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
  const bool dialer = (flags & 1) != 0;
  const bool done = dialer ? RunDialer(decoder, config) : RunListener(decoder, fed, config);
  KVWIRE_FUZZ_CHECK(!done || config.shared_secret.empty());
  return 0;
}
