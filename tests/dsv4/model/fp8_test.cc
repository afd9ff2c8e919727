// fp8 e4m3 / UE8M0 / bf16 codecs and the 584-byte KV record, against exhaustive or
// double-precision references.
#include "examples/dsv4/model/fp8.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kvwire/deepseek.h"
#include "kvwire/layout.h"

namespace dsv4 {
namespace {

// Nearest finite e4m3 code by brute force (ties: even code), saturating at 448.
uint8_t ReferenceEncode(double v) {
  if (v >= 448) return 0x7E;
  if (v <= -448) return 0xFE;
  int best = -1;
  double best_err = 0;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;  // NaN
    const double d = E4m3Decode(static_cast<uint8_t>(code));
    if (std::signbit(d) != std::signbit(v)) continue;
    const double err = std::fabs(d - v);
    if (best < 0 || err < best_err || (err == best_err && (code & 1) == 0 && (best & 1) == 1)) {
      best = code;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(Fp8Test, DecodeKnownCodes) {
  EXPECT_EQ(E4m3Decode(0x7E), 448.0f);
  EXPECT_EQ(E4m3Decode(0xFE), -448.0f);
  EXPECT_EQ(E4m3Decode(0x38), 1.0f);
  EXPECT_EQ(E4m3Decode(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4m3Decode(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(E4m3Decode(0x7F)));
  EXPECT_TRUE(std::isnan(E4m3Decode(0xFF)));
}

TEST(Fp8Test, EveryFiniteCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    const uint8_t c = static_cast<uint8_t>(code);
    const uint8_t back = E4m3Encode(E4m3Decode(c));
    if (code == 0x80) {
      EXPECT_EQ(back, 0x80);  // -0 keeps its sign
    } else {
      EXPECT_EQ(back, c) << "code " << code;
    }
  }
}

TEST(Fp8Test, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(E4m3Encode(1.0625f), 0x38);  // halfway 1.0 / 1.125 -> even mantissa
  EXPECT_EQ(E4m3Encode(1.1875f), 0x3A);  // halfway 1.125 / 1.25 -> even mantissa
  EXPECT_EQ(E4m3Encode(500.0f), 0x7E);
  EXPECT_EQ(E4m3Encode(-1e30f), 0xFE);
  EXPECT_EQ(E4m3Encode(INFINITY), 0x7E);
  EXPECT_EQ(E4m3Encode(NAN) & 0x7F, 0x7F);
  EXPECT_EQ(E4m3Encode(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest subnormal
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> exp_dist(-12, 9.5);
  for (int i = 0; i < 20000; ++i) {
    const double mag = std::pow(2.0, exp_dist(rng));
    const float v = static_cast<float>((rng() & 1) ? mag : -mag);
    ASSERT_EQ(E4m3Encode(v), ReferenceEncode(v)) << "value " << v;
  }
  // Every midpoint between neighbouring codes goes to the even one.
  for (int code = 0; code < 0x7D; ++code) {
    const double mid = (E4m3Decode(code) + E4m3Decode(code + 1)) / 2.0;
    const uint8_t want = (code & 1) == 0 ? code : code + 1;
    EXPECT_EQ(E4m3Encode(static_cast<float>(mid)), want) << "midpoint after code " << code;
  }
}

TEST(Fp8Test, Ue8m0Scales) {
  for (int e = 0; e < 255; ++e) {
    EXPECT_EQ(Ue8m0Encode(Ue8m0Decode(static_cast<uint8_t>(e))), e);
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> exp_dist(-10, 20);
  for (int i = 0; i < 1000; ++i) {
    const float amax = static_cast<float>(std::pow(2.0, exp_dist(rng)));
    const float s = Ue8m0ScaleFor(amax);
    EXPECT_LE(amax / s, 448.0f);
    EXPECT_GT(amax / s, 224.0f) << amax;  // the smallest power of two that fits
  }
  EXPECT_EQ(Ue8m0ScaleFor(448.0f), 1.0f);
  EXPECT_EQ(Ue8m0ScaleFor(0.0f), Ue8m0ScaleFor(1e-4f));
}

TEST(Fp8Test, Bf16RoundsToNearestEven) {
  EXPECT_EQ(Bf16Encode(1.0f), 0x3F80);
  float v;
  uint32_t bits = 0x3F808000;  // exactly halfway: 0x3F80 is even
  std::memcpy(&v, &bits, 4);
  EXPECT_EQ(Bf16Encode(v), 0x3F80);
  bits = 0x3F818000;  // halfway, 0x3F81 odd -> 0x3F82
  std::memcpy(&v, &bits, 4);
  EXPECT_EQ(Bf16Encode(v), 0x3F82);
  EXPECT_EQ(Bf16Decode(0x4040), 3.0f);
}

TEST(Fp8Test, KvRecordRoundTripWithinBound) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int entries = 64;
  std::vector<uint8_t> page(kvwire::Dsv4PageBytes(entries), 0xCC);
  ASSERT_EQ(page.size(), 37440u);
  std::vector<std::vector<float>> kv(entries, std::vector<float>(kKvDim));
  for (int e = 0; e < entries; ++e) {
    const float tile_scale = std::ldexp(1.0f, e % 17 - 8);  // wide dynamic range per record
    for (int i = 0; i < kKvDim; ++i) kv[e][i] = normal(rng) * tile_scale * (1 + i / 64);
    EncodeKvRecord(kv[e].data(), page.data(), entries, e);
  }
  for (int e = 0; e < entries; ++e) {
    std::vector<float> out(kKvDim);
    DecodeKvRecord(page.data(), entries, e, out.data());
    for (int t = 0; t < kNopeTiles; ++t) {
      float amax = 0;
      for (int i = 0; i < kFp8Tile; ++i) amax = std::max(amax, std::fabs(kv[e][t * 64 + i]));
      const double scale = Ue8m0ScaleFor(amax);
      for (int i = t * 64; i < (t + 1) * 64; ++i) {
        // 3 mantissa bits: half an ulp is 2^-4 relative; subnormals: 2^-10 of the scale.
        const double bound = std::max(std::fabs(kv[e][i]) / 16.0, scale * std::ldexp(1.0, -10));
        ASSERT_LE(std::fabs(out[i] - kv[e][i]), bound) << "record " << e << " dim " << i;
      }
    }
    for (int i = kNopeDim; i < kKvDim; ++i) {
      ASSERT_LE(std::fabs(out[i] - kv[e][i]), std::fabs(kv[e][i]) / 256.0) << i;  // bf16
    }
  }
  // Layout: data rows of 576 bytes first, then 8-byte scale rows whose pad byte is zero, and
  // the bytes past the last scale row untouched.
  for (int e = 0; e < entries; ++e) EXPECT_EQ(page[entries * 576 + e * 8 + 7], 0);
  for (size_t b = entries * 584; b < page.size(); ++b) ASSERT_EQ(page[b], 0xCC);
  // A record's scales are where the layout says: change one, only its tile changes.
  std::vector<float> before(kKvDim), after(kKvDim);
  DecodeKvRecord(page.data(), entries, 5, before.data());
  page[entries * 576 + 5 * 8 + 2] += 1;  // tile 2 of record 5: scale doubles
  DecodeKvRecord(page.data(), entries, 5, after.data());
  for (int i = 0; i < kKvDim; ++i) {
    if (i >= 128 && i < 192) {
      EXPECT_EQ(after[i], 2 * before[i]);
    } else {
      EXPECT_EQ(after[i], before[i]);
    }
  }
}

TEST(Fp8Test, IndexerKeyRoundTrip) {
  const int entries = 64;
  std::vector<uint8_t> page(kvwire::Dsv4PageBytes(entries, 132), 0);
  ASSERT_EQ(page.size(), 8640u);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> k(kIndexDim), out(kIndexDim);
  for (float& x : k) x = normal(rng);
  EncodeIndexerKey(k.data(), page.data(), entries, 9);
  DecodeIndexerKey(page.data(), entries, 9, out.data());
  float amax = 0;
  for (float x : k) amax = std::max(amax, std::fabs(x));
  float scale;
  std::memcpy(&scale, page.data() + entries * 128 + 9 * 4, 4);
  EXPECT_FLOAT_EQ(scale, amax / 448.0f);
  for (int i = 0; i < kIndexDim; ++i) {
    EXPECT_LE(std::fabs(out[i] - k[i]), std::max(std::fabs(k[i]) / 16.0, scale / 512.0)) << i;
  }
}

}  // namespace
}  // namespace dsv4
