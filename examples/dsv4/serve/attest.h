// Proof that a server discovered through etcd belongs to the deployment: etcd is a directory,
// and whoever can write to it could otherwise register a "decode" that receives every user's
// prompt. The router sends a fresh random nonce to the instance's HTTP port
// (GET /v1/kvwire/attest?nonce=HEX); the instance answers the HMAC-SHA256, under the
// deployment's shared secret, of the nonce and of what its etcd record claims (engine id,
// role, HTTP and KV addresses). A server without the secret cannot answer; one that relays
// the challenge to a real server gets a proof for that server's addresses, not its own.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_ATTEST_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_ATTEST_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dsv4::serve {

inline constexpr char kAttestPath[] = "/v1/kvwire/attest";
// Nonce: hex of 16 to 64 random bytes.
inline constexpr size_t kMinAttestNonceHex = 32, kMaxAttestNonceHex = 128;

struct AttestClaim {
  std::string engine_id, role, http_address, kv_address;
};

// Hex of HMAC-SHA256(secret, "kvwire-dsv4-attest-v1" and each field, newline-separated).
std::string AttestProof(absl::string_view secret, absl::string_view nonce_hex,
                        const AttestClaim& claim);

// The nonce of a GET kAttestPath target ("...?nonce=HEX"); InvalidArgument when absent or
// not hex of the allowed length.
absl::StatusOr<std::string> AttestNonce(absl::string_view target);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_ATTEST_H_
