// The CPU reference of the fp8 KV record (what the GPU kernels are checked against), checked
// against independent arithmetic: nearest-value search over every e4m3 code, double-precision
// scale bounds, and the page layout of kvwire's DeepSeek-V4 presets.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

#include "kvwire/deepseek.h"
#include "kvwire/layout.h"
#include "src/gpu/kv_record.h"
#include "src/gpu/kv_record_cpu.h"

#if KVWIRE_GPU_TEST_DSV4
#include "examples/dsv4/model/fp8.h"
#endif

namespace kvwire::gpu {
namespace {

// Independent e4m3 decode: sign, 4-bit exponent (bias 7), 3-bit mantissa, subnormals.
double RefE4m3Value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double mag = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (code & 0x80) ? -mag : mag;
}

// Independent e4m3 encode: the nearest finite code by exhaustive search, ties to the even
// mantissa, saturating; used to check FloatToE4m3.
int RefE4m3Encode(float x) {
  const double v = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x7f; ++c) {  // 0x7f is NaN
    const double err = std::fabs(RefE4m3Value(c) - v);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return (std::signbit(x) ? 0x80 : 0) | best;
}

TEST(E4m3, DecodeMatchesDefinitionForEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(E4m3ToFloat(static_cast<uint8_t>(c)))) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(E4m3ToFloat(static_cast<uint8_t>(c))), RefE4m3Value(c)) << c;
  }
}

TEST(E4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(FloatToE4m3(E4m3ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(E4m3, MidpointsRoundToEven) {
  // Every midpoint between neighbouring finite codes, and values just either side of it.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = E4m3ToFloat(static_cast<uint8_t>(c));
    const float hi = E4m3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact: both have few mantissa bits
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f), -mid}) {
      EXPECT_EQ(FloatToE4m3(x), RefE4m3Encode(x)) << "x=" << x << " between codes " << c;
    }
  }
}

TEST(E4m3, SpecialValues) {
  EXPECT_EQ(FloatToE4m3(448.0f), 0x7e);
  EXPECT_EQ(FloatToE4m3(1e6f), 0x7e);  // saturates
  EXPECT_EQ(FloatToE4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(FloatToE4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(FloatToE4m3(1.0f), 0x38);
  EXPECT_EQ(FloatToE4m3(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.0f, -9)), 0x01);   // smallest subnormal
  EXPECT_EQ(FloatToE4m3(std::ldexp(3.0f, -11)), 0x01);  // 0.75 * 2^-9 -> 1
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.0f, -10)), 0x00);  // tie -> even (0)
  EXPECT_EQ(FloatToE4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 * 2^-9: tie -> 2
  EXPECT_EQ(FloatToE4m3(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(E4m3, RandomValuesMatchExhaustiveSearch) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exp(-14.0f, 9.5f);
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = unit(rng) * std::exp2(std::floor(exp(rng))) * (i % 2 ? -1.0f : 1.0f);
    ASSERT_EQ(FloatToE4m3(x), RefE4m3Encode(x)) << "x=" << x;
  }
}

TEST(Bf16, RoundsToNearestEven) {
  std::mt19937 rng(11);
  // Below 0x7f000000: near FLT_MAX the upper neighbour is inf, which the search cannot weigh.
  std::uniform_int_distribution<uint32_t> bits(0, 0x7effffffu);
  for (int i = 0; i < 20000; ++i) {
    const uint32_t b = bits(rng) | (i % 2 ? 0x80000000u : 0);
    float x;
    std::memcpy(&x, &b, sizeof x);
    const uint16_t h = FloatToBf16(x);
    // The two bf16 neighbours of x (truncation and the next one away from zero).
    const uint16_t down = static_cast<uint16_t>(b >> 16);
    const uint16_t up = static_cast<uint16_t>(down + 1);
    const double dx = x, ddown = Bf16ToFloat(down), dup = Bf16ToFloat(up);
    const double e_down = std::fabs(dx - ddown), e_up = std::fabs(dup - dx);
    const uint16_t want = e_down < e_up ? down : e_up < e_down ? up : ((down & 1) ? up : down);
    ASSERT_EQ(h, want) << "x=" << x;
  }
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
}

TEST(ScaleByte, IsTheSmallestPowerOfTwoThatFits) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> lg(-20.0, 100.0);
  for (int i = 0; i < 20000; ++i) {
    const float amax = static_cast<float>(std::exp2(lg(rng)));
    const uint8_t b = ScaleByteForAmax(AbsBits(amax));
    const double scale = std::ldexp(1.0, b - 127);
    ASSERT_GE(448.0 * scale, amax) << amax;
    if (b > kMinScaleByte) {
      ASSERT_LT(448.0 * scale / 2, amax) << amax;
    }
  }
  // Exact fits: 448 * 2^k needs scale 2^k; a hair more needs the next power.
  EXPECT_EQ(ScaleByteForAmax(AbsBits(448.0f)), 127);
  EXPECT_EQ(ScaleByteForAmax(AbsBits(std::nextafter(448.0f, 1e9f))), 128);
  EXPECT_EQ(ScaleByteForAmax(AbsBits(224.0f)), 126);
  EXPECT_EQ(ScaleByteForAmax(0), kMinScaleByte);
  EXPECT_EQ(ScaleByteForAmax(AbsBits(1e-4f)), kMinScaleByte);  // the 1e-4 floor
  EXPECT_EQ(ScaleByteForAmax(AbsBits(1e-6f)), kMinScaleByte);
  EXPECT_EQ(ScaleByteForAmax(AbsBits(std::numeric_limits<float>::quiet_NaN())), kMinScaleByte);
  EXPECT_EQ(ScaleByteForAmax(AbsBits(std::numeric_limits<float>::infinity())), kMaxScaleByte);
  EXPECT_EQ(ScaleByteForAmax(AbsBits(std::numeric_limits<float>::max())), kMaxScaleByte);
}

TEST(KvRecord, LayoutConstantsMatchTheDsv4Presets) {
  EXPECT_EQ(kKvRecordBytes, kDsv4RecordBytes);
  EXPECT_EQ(kKvDataRowBytes, kDsv4PageAlign);
  for (uint64_t n : {1, 2, 7, 64, 65, 256}) EXPECT_EQ(KvPageBytes(n), Dsv4PageBytes(n)) << n;
  EXPECT_EQ(KvPageBytes(64), 37440u);
  EXPECT_EQ(KvPageBytes(2), 1728u);
}

std::vector<float> RandomTokens(uint32_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> lg(-12.0f, 12.0f);
  std::vector<float> v(static_cast<size_t>(n) * kKvInputDims);
  for (uint32_t t = 0; t < n; ++t) {
    // Every tile its own magnitude, so the per-tile scales differ.
    for (uint32_t d = 0; d < kKvInputDims; d += kKvTileDims) {
      const float mag = std::exp2(lg(rng));
      for (uint32_t j = 0; j < kKvTileDims; ++j) v[t * kKvInputDims + d + j] = normal(rng) * mag;
    }
  }
  return v;
}

TEST(KvRecord, EncodeDecodeStaysWithinFp8AndBf16Error) {
  const uint32_t n = 50;
  const std::vector<float> src = RandomTokens(n, 1);
  std::vector<uint8_t> data(kKvDataRowBytes), scales(kKvScaleRowBytes, 0xaa);
  std::vector<float> out(kKvInputDims);
  for (uint32_t t = 0; t < n; ++t) {
    const float* x = &src[t * kKvInputDims];
    EncodeKvRecordCpu(x, data.data(), scales.data());
    DecodeKvRecordCpu(data.data(), scales.data(), out.data());
    EXPECT_EQ(scales[kKvTiles], 0) << "pad byte";
    for (uint32_t tile = 0; tile < kKvTiles; ++tile) {
      float amax = 0;
      for (uint32_t j = 0; j < kKvTileDims; ++j) {
        amax = std::max(amax, std::fabs(x[tile * kKvTileDims + j]));
      }
      const double scale = std::ldexp(1.0, scales[tile] - 127);
      ASSERT_GE(448.0 * scale, amax);
      for (uint32_t j = 0; j < kKvTileDims; ++j) {
        const uint32_t d = tile * kKvTileDims + j;
        // e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals; the subnormal range
        // (below 2^-6 * scale) has absolute error <= 2^-10 * scale.
        const double tol = std::max(std::fabs(x[d]) / 16.0, std::ldexp(scale, -10));
        ASSERT_LE(std::fabs(out[d] - x[d]), tol) << "token " << t << " dim " << d;
      }
    }
    for (uint32_t j = 0; j < kKvRopeDims; ++j) {
      const uint32_t d = kKvNopeDims + j;
      ASSERT_LE(std::fabs(out[d] - x[d]), std::fabs(x[d]) / 256.0) << "rope dim " << j;
    }
  }
}

TEST(KvRecord, PagedEncodePutsDataRowsFirstThenScaleRows) {
  const uint32_t block_size = 64, blocks = 3, n = 100;
  const uint64_t page = KvPageBytes(block_size);
  const std::vector<float> src = RandomTokens(n, 2);
  std::vector<int64_t> slots(n);
  for (uint32_t i = 0; i < n; ++i) slots[i] = (i * 37 + 5) % (block_size * blocks);
  slots[10] = -1;  // padding token: nothing written
  std::vector<uint8_t> cache(page * blocks, 0xcd);
  KvEncodeArgs args;
  args.src = src.data();
  args.slots = slots.data();
  args.cache = cache.data();
  args.page_bytes = page;
  args.block_size = block_size;
  args.num_slots = block_size * blocks;
  args.num_tokens = n;
  ASSERT_TRUE(EncodeKvRecordsCpu(args).ok());

  std::vector<bool> written(block_size * blocks, false);
  std::vector<uint8_t> data(kKvDataRowBytes), scales(kKvScaleRowBytes);
  for (uint32_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    written[slots[i]] = true;
    EncodeKvRecordCpu(&src[i * kKvInputDims], data.data(), scales.data());
    const uint8_t* p = cache.data() + slots[i] / block_size * page;
    const uint64_t e = slots[i] % block_size;
    ASSERT_EQ(std::memcmp(p + e * 576, data.data(), 576), 0) << "token " << i;
    ASSERT_EQ(std::memcmp(p + block_size * 576 + e * 8, scales.data(), 8), 0) << "token " << i;
  }
  // Slots no token maps to keep their old bytes (0xcd), data and scale rows alike.
  for (uint32_t s = 0; s < block_size * blocks; ++s) {
    if (written[s]) continue;
    const uint8_t* p = cache.data() + s / block_size * page;
    const uint64_t e = s % block_size;
    for (uint64_t b = 0; b < 576; ++b) ASSERT_EQ(p[e * 576 + b], 0xcd) << "slot " << s;
    for (uint64_t b = 0; b < 8; ++b) ASSERT_EQ(p[block_size * 576 + e * 8 + b], 0xcd);
  }
  // The tail of each page past the scale rows (37,440 - 64 x 584 = 64 bytes) is untouched.
  for (uint32_t b = 0; b < blocks; ++b) {
    for (uint64_t i = block_size * kKvRecordBytes; i < page; ++i) {
      ASSERT_EQ(cache[b * page + i], 0xcd);
    }
  }
}

#if KVWIRE_GPU_TEST_DSV4
TEST(KvRecord, MatchesTheReferenceEnginesEncoderByteForByte) {
  const uint32_t n = 200;
  std::vector<float> src = RandomTokens(n, 4);
  // Edge tiles: all zeros, below the 1e-4 floor, a NaN among normal values.
  std::fill(src.begin(), src.begin() + kKvTileDims, 0.0f);
  for (uint32_t j = 0; j < kKvTileDims; ++j) src[kKvInputDims + j] = 3e-6f * (j % 7) - 1e-5f;
  src[2 * kKvInputDims + 5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint8_t> mine(kKvRecordBytes), theirs(kKvRecordBytes);
  for (uint32_t t = 0; t < n; ++t) {
    const float* x = &src[t * kKvInputDims];
    EncodeKvRecordCpu(x, mine.data(), mine.data() + kKvDataRowBytes);
    dsv4::EncodeKvRecord(x, theirs.data(), /*entries=*/1, /*index=*/0);
    ASSERT_EQ(mine, theirs) << "token " << t;
  }
}
#endif

TEST(KvRecord, BadArgumentsAreRejectedBeforeAnyWrite) {
  std::vector<float> src(kKvInputDims, 1.0f);
  std::vector<uint8_t> cache(KvPageBytes(4), 0);
  int64_t slot = 4;  // one past the only page
  KvEncodeArgs args;
  args.src = src.data();
  args.slots = &slot;
  args.cache = cache.data();
  args.page_bytes = cache.size();
  args.block_size = 4;
  args.num_slots = 4;
  args.num_tokens = 1;
  absl::Status s = EncodeKvRecordsCpu(args);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(cache, std::vector<uint8_t>(cache.size(), 0));
  args.page_bytes = 4 * kKvRecordBytes - 1;
  EXPECT_EQ(ValidateKvEncodeArgs(args).code(), absl::StatusCode::kInvalidArgument);
  args.page_bytes = cache.size();
  args.src_stride = 100;
  EXPECT_EQ(ValidateKvEncodeArgs(args).code(), absl::StatusCode::kInvalidArgument);
  args.src_stride = kKvInputDims;
  args.block_size = 0;
  EXPECT_EQ(ValidateKvEncodeArgs(args).code(), absl::StatusCode::kInvalidArgument);
  args.block_size = 4;
  args.num_slots = 0;
  EXPECT_EQ(ValidateKvEncodeArgs(args).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvwire::gpu
