// The pure half of the control-channel handshake: building and checking Hellos, HMAC proofs,
// and Reject messages. The socket work lives in dialer.cc and inbound_handshake.cc.
//
// Exchange (D = dialer, L = listener; Td, Tl = session tokens, see HandshakeConfig):
//   without a secret:
//     D -> L  Hello{version, compat_hash, has_secret = false, session_token = Td}
//     L -> D  HelloAck{Hello{..., session_token = Tl}}
//   with a secret:
//     D -> L  Hello{version, compat_hash, has_secret, auth_nonce = Nd}             no token
//     L -> D  HelloAck{Hello{..., auth_nonce = Nl},
//                      auth_proof = HMAC(secret, "kvwire-listener" | Nd | Nl)}    no token
//     D -> L  AuthProof{HMAC(secret, "kvwire-dialer" | Nl | Nd), session_token = Td}
//     L -> D  Welcome{session_token = Tl}
// With a secret, each token is issued (made live) and sent only after its side has verified
// the other's proof, so a party that does not know the secret never holds a live token, and
// both sides know the handshake succeeded before anything else flows. Either side may send
// Reject{code, reason} instead of its next message and close.
#ifndef KVWIRE_CONTROL_HANDSHAKE_H_
#define KVWIRE_CONTROL_HANDSHAKE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#include "proto/kvwire.pb.h"
#include "src/control/control.h"

namespace kvwire::control {

// How the two ends are named in handshake errors, from the point of view of the side that
// runs the check.
struct HandshakeRoles {
  absl::string_view local;  // e.g. "listener", "this engine"
  absl::string_view peer;   // e.g. "dialer", "peer"
};
inline constexpr HandshakeRoles kListenerRoles{"listener", "dialer"};
inline constexpr HandshakeRoles kDialerRoles{"this engine", "peer"};

// `"name" (address)`, or just the address when the peer sent no name.
std::string DescribePeer(const pb::Hello& hello, absl::string_view address);

// Name of the message an Envelope carries ("Hello", "Heartbeat", ...).
const char* MessageName(const pb::Envelope& envelope);

// Overwrites the fields the handshake owns: protocol version, compatibility hash, has_secret,
// and a fresh auth nonce when the config has a secret (cleared otherwise).
absl::StatusOr<pb::Hello> PrepareHello(pb::Hello hello, const HandshakeConfig& config);

// Checks a peer's Hello against the local config: protocol version, compatibility hash,
// shared secret on both sides or neither, nonce size. Errors name both values.
absl::Status CheckPeerHello(const pb::Hello& peer, absl::string_view peer_address,
                            const HandshakeConfig& config, HandshakeRoles roles);

// The two HMAC proofs of the exchange above. Nonces have a fixed size, so the concatenation
// is unambiguous; the labels keep a proof of one direction from being replayed as the other.
std::string ListenerProof(absl::string_view secret, absl::string_view dialer_nonce,
                          absl::string_view listener_nonce);
std::string DialerProof(absl::string_view secret, absl::string_view listener_nonce,
                        absl::string_view dialer_nonce);
// Constant time; false unless `received` is a full-size proof equal to `expected`.
bool ProofMatches(absl::string_view expected, absl::string_view received);

// Reject carrying `status` (code and message).
pb::Envelope MakeReject(const absl::Status& status);
// The status a Reject or Goodbye stands for: its code (Unknown if not a valid code,
// `ok_code` for OK) and `prefix` + reason.
absl::Status StatusFromWire(uint32_t code, absl::string_view reason, absl::string_view prefix,
                            absl::StatusCode ok_code = absl::StatusCode::kUnavailable);

}  // namespace kvwire::control

#endif  // KVWIRE_CONTROL_HANDSHAKE_H_
