#include "examples/dsv4/serve/attest.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

#include "src/control/hmac.h"

namespace dsv4::serve {

std::string AttestProof(absl::string_view secret, absl::string_view nonce_hex,
                        const AttestClaim& claim) {
  const std::string message =
      absl::StrCat("kvwire-dsv4-attest-v1\n", nonce_hex, "\n", claim.engine_id, "\n", claim.role,
                   "\n", claim.http_address, "\n", claim.kv_address);
  return absl::BytesToHexString(kvwire::control::HmacSha256(secret, message));
}

absl::StatusOr<std::string> AttestNonce(absl::string_view target) {
  const size_t q = target.find("?nonce=");
  if (q == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(kAttestPath, " needs ?nonce=HEX"));
  }
  const absl::string_view nonce = target.substr(q + 7);
  bool hex = nonce.size() % 2 == 0;
  for (char ch : nonce) hex = hex && absl::ascii_isxdigit(static_cast<unsigned char>(ch));
  if (!hex || nonce.size() < kMinAttestNonceHex || nonce.size() > kMaxAttestNonceHex) {
    return absl::InvalidArgumentError(absl::StrCat("nonce must be hex of ", kMinAttestNonceHex / 2,
                                                   " to ", kMaxAttestNonceHex / 2, " bytes"));
  }
  return std::string(nonce);
}

}  // namespace dsv4::serve
