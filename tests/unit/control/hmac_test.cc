#include "src/control/hmac.h"

#include <string>

#include <gtest/gtest.h>

#include "absl/strings/escaping.h"

#include "src/control/handshake.h"

namespace kvwire::control {
namespace {

std::string Hex(const std::string& bytes) { return absl::BytesToHexString(bytes); }

TEST(HmacTest, Rfc4231TestCase1) {
  EXPECT_EQ(Hex(HmacSha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

TEST(HmacTest, Rfc4231TestCase2) {
  EXPECT_EQ(Hex(HmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(HmacTest, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(HmacTest, RandomNoncesAreFreshAndSized) {
  absl::StatusOr<std::string> a = RandomNonce();
  absl::StatusOr<std::string> b = RandomNonce();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), kAuthNonceBytes);
  EXPECT_NE(*a, *b);
}

TEST(HmacTest, ProofsAreDirectional) {
  const std::string n1(32, '1'), n2(32, '2');
  EXPECT_NE(ListenerProof("secret", n1, n2), DialerProof("secret", n2, n1));
  EXPECT_NE(ListenerProof("secret", n1, n2), ListenerProof("other", n1, n2));
  EXPECT_TRUE(ProofMatches(ListenerProof("secret", n1, n2), ListenerProof("secret", n1, n2)));
  // An empty proof never matches, even an empty expectation.
  EXPECT_FALSE(ProofMatches("", ""));
}

}  // namespace
}  // namespace kvwire::control
