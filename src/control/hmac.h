// HMAC-SHA256, constant-time comparison and random nonces for the handshake's
// challenge-response, on OpenSSL libcrypto.
#ifndef KVWIRE_CONTROL_HMAC_H_
#define KVWIRE_CONTROL_HMAC_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvwire::control {

inline constexpr size_t kHmacSha256Bytes = 32;
inline constexpr size_t kAuthNonceBytes = 32;

// The 32-byte HMAC-SHA256 of `data` under `key`; empty if OpenSSL fails (callers check the
// size, so two failures never compare equal as proofs).
std::string HmacSha256(absl::string_view key, absl::string_view data);

// Compares in time that depends only on the lengths, so a proof cannot be guessed byte by
// byte from response timing.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// `size` bytes from OpenSSL's CSPRNG; Internal error if it is not seeded.
absl::StatusOr<std::string> RandomNonce(size_t size = kAuthNonceBytes);

}  // namespace kvwire::control

#endif  // KVWIRE_CONTROL_HMAC_H_
