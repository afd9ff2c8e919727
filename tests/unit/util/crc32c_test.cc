#include "src/util/crc32c.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvwire {
namespace {

TEST(Crc32cTest, KnownValues) {
  // RFC 3720 (iSCSI) B.4 and the usual check value.
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xff);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
}

TEST(Crc32cTest, HardwareAndTableAgreeAtEveryLengthAndAlignment) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> buf(3 * 4096 * 2 + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  // Lengths around the 3-stream block sizes (256 and 4096 bytes each), unaligned starts.
  const size_t lengths[] = {0,
                            1,
                            7,
                            8,
                            9,
                            255,
                            767,
                            768,
                            769,
                            1000,
                            3 * 4096 - 1,
                            3 * 4096,
                            3 * 4096 + 13,
                            2 * 3 * 4096 + 5};
  for (size_t len : lengths) {
    for (size_t start = 0; start < 9; ++start) {
      ASSERT_LE(start + len, buf.size());
      EXPECT_EQ(Crc32c(buf.data() + start, len), Crc32cPortable(buf.data() + start, len))
          << "length " << len << " start " << start << " hardware " << Crc32cHardware();
    }
  }
}

TEST(Crc32cTest, ContinuesAcrossPieces) {
  const std::string s = "the quick brown fox jumps over the lazy dog, twice over";
  const uint32_t whole = Crc32c(s.data(), s.size());
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    EXPECT_EQ(Crc32c(s.data() + cut, s.size() - cut, Crc32c(s.data(), cut)), whole) << cut;
  }
}

TEST(Crc32cTest, OneFlippedBitChangesIt) {
  std::vector<unsigned char> buf(1 << 20, 0x5a);
  const uint32_t before = Crc32c(buf.data(), buf.size());
  buf[buf.size() / 2] ^= 0x20;
  EXPECT_NE(Crc32c(buf.data(), buf.size()), before);
}

}  // namespace
}  // namespace kvwire
