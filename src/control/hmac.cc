#include "src/control/hmac.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvwire::control {

std::string HmacSha256(absl::string_view key, absl::string_view data) {
  // OpenSSL wants a non-null key pointer even for an empty key.
  static const unsigned char kEmpty = 0;
  const void* key_ptr = key.empty() ? &kEmpty : static_cast<const void*>(key.data());
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int out_len = 0;
  if (HMAC(EVP_sha256(), key_ptr, static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(), out,
           &out_len) == nullptr) {
    return std::string();
  }
  return std::string(reinterpret_cast<const char*>(out), out_len);
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

absl::StatusOr<std::string> RandomNonce(size_t size) {
  std::string nonce(size, '\0');
  if (size > 0 &&
      RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(size)) != 1) {
    return absl::InternalError(absl::StrCat("RAND_bytes failed to produce a ", size,
                                            "-byte nonce: OpenSSL error ", ERR_get_error()));
  }
  return nonce;
}

}  // namespace kvwire::control
