// ReadSecretFile: the secret less one trailing newline; unsafe or odd files refused with an
// error naming the file and the fix.
#include "src/util/secret_file.h"

#include <sys/stat.h>

#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace kvwire {
namespace {

std::string Write(const std::string& name, const std::string& bytes, mode_t mode) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  chmod(path.c_str(), mode);
  return path;
}

TEST(SecretFileTest, ReadsTheSecretWithoutOneTrailingNewline) {
  EXPECT_EQ(*ReadSecretFile(Write("s1", "abc\n", 0600)), "abc");
  EXPECT_EQ(*ReadSecretFile(Write("s2", "abc\r\n", 0640)), "abc");
  EXPECT_EQ(*ReadSecretFile(Write("s3", "abc\n\n", 0400)), "abc\n");
  EXPECT_EQ(*ReadSecretFile(Write("s4", std::string("a\0b", 3), 0600)), std::string("a\0b", 3));
}

TEST(SecretFileTest, RefusesUnsafeOrOddFiles) {
  const std::pair<std::string, std::string> bad[] = {
      {Write("r1", "abc", 0644), "chmod 600"},
      {Write("r2", "abc", 0620), "written"},
      {Write("r3", "\n", 0600), "empty"},
      {Write("r4", std::string(kMaxSecretFileBytes + 1, 'x'), 0600), "at most"},
      {testing::TempDir() + "/no-such-secret", "cannot open"},
      {testing::TempDir(), "not a regular file"},
  };
  for (const auto& [path, want] : bad) {
    absl::StatusOr<std::string> s = ReadSecretFile(path);
    ASSERT_FALSE(s.ok()) << path;
    EXPECT_NE(s.status().message().find(want), std::string::npos) << s.status();
    EXPECT_NE(s.status().message().find(path), std::string::npos) << s.status();
  }
}

}  // namespace
}  // namespace kvwire
