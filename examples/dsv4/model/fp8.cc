// fp8 codecs and the DeepSeek-V4 record formats.
#include "examples/dsv4/model/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

namespace dsv4 {

uint8_t E4m3Encode(float v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= kE4m3Max) return sign | 0x7E;
  if (a < 0x1p-6) {
    // Subnormal: steps of 2^-9; a rounded value of 8 is the smallest normal, code 0x08.
    const double m = std::nearbyint(a * 0x1p9);
    return sign | static_cast<uint8_t>(m);
  }
  int e = 0;
  const double f = std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  int exponent = e - 1;                // a = (2f) * 2^exponent, 2f in [1, 2)
  double q = std::nearbyint((2.0 * f - 1.0) * 8.0);
  if (q == 8.0) {
    q = 0.0;
    ++exponent;
  }
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | static_cast<int>(q));
}

namespace {

float E4m3DecodeSlow(uint8_t b) {
  const int e = (b >> 3) & 0xF;
  const int m = b & 0x7;
  float v;
  if (e == 0xF && m == 0x7) {
    v = std::nanf("");
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -9);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
  }
  return (b & 0x80) ? -v : v;
}

// Decoding is on the attention path (every key, every step): a table, not ldexp.
const std::array<float, 256>& E4m3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t;
    for (int i = 0; i < 256; ++i) t[i] = E4m3DecodeSlow(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

}  // namespace

float E4m3Decode(uint8_t b) { return E4m3Table()[b]; }

uint8_t Ue8m0Encode(float power_of_two) {
  int e = 0;
  std::frexp(power_of_two, &e);  // 2^k = 0.5 * 2^(k+1)
  return static_cast<uint8_t>(std::clamp(e - 1 + 127, 0, 254));
}

float Ue8m0Decode(uint8_t e) { return std::ldexp(1.0f, static_cast<int>(e) - 127); }

float Ue8m0ScaleFor(float amax) {
  const double x = std::max(static_cast<double>(amax), 1e-4) / kE4m3Max;
  int e = 0;
  const double f = std::frexp(x, &e);  // x = f * 2^e, f in [0.5, 1)
  const int k = f == 0.5 ? e - 1 : e;  // ceil(log2(x))
  return std::ldexp(1.0f, k);
}

uint16_t Bf16Encode(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (std::isnan(v)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

float Bf16Decode(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

void EncodeKvRecord(const float* kv, uint8_t* page, int entries, int index) {
  uint8_t* data = page + static_cast<size_t>(index) * kRecordDataBytes;
  uint8_t* scales = page + static_cast<size_t>(entries) * kRecordDataBytes +
                    static_cast<size_t>(index) * kRecordScaleBytes;
  for (int t = 0; t < kNopeTiles; ++t) {
    const float* x = kv + t * kFp8Tile;
    float amax = 0.0f;
    for (int i = 0; i < kFp8Tile; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = Ue8m0ScaleFor(amax);
    for (int i = 0; i < kFp8Tile; ++i) data[t * kFp8Tile + i] = E4m3Encode(x[i] / scale);
    scales[t] = Ue8m0Encode(scale);
  }
  scales[kNopeTiles] = 0;
  for (int i = 0; i < kRopeDim; ++i) {
    const uint16_t b = Bf16Encode(kv[kNopeDim + i]);
    std::memcpy(data + kNopeDim + 2 * i, &b, 2);  // little-endian host
  }
}

void DecodeKvRecord(const uint8_t* page, int entries, int index, float* kv) {
  const uint8_t* data = page + static_cast<size_t>(index) * kRecordDataBytes;
  const uint8_t* scales = page + static_cast<size_t>(entries) * kRecordDataBytes +
                          static_cast<size_t>(index) * kRecordScaleBytes;
  const std::array<float, 256>& table = E4m3Table();
  for (int t = 0; t < kNopeTiles; ++t) {
    const float scale = Ue8m0Decode(scales[t]);
    for (int i = 0; i < kFp8Tile; ++i) kv[t * kFp8Tile + i] = table[data[t * kFp8Tile + i]] * scale;
  }
  for (int i = 0; i < kRopeDim; ++i) {
    uint16_t b;
    std::memcpy(&b, data + kNopeDim + 2 * i, 2);
    kv[kNopeDim + i] = Bf16Decode(b);
  }
}

void EncodeIndexerKey(const float* k, uint8_t* page, int entries, int index) {
  uint8_t* data = page + static_cast<size_t>(index) * kIndexDim;
  uint8_t* scale_at = page + static_cast<size_t>(entries) * kIndexDim +
                      static_cast<size_t>(index) * kIndexScaleBytes;
  float amax = 0.0f;
  for (int i = 0; i < kIndexDim; ++i) amax = std::max(amax, std::fabs(k[i]));
  const float scale = std::max(amax, 1e-4f) / kE4m3Max;
  for (int i = 0; i < kIndexDim; ++i) data[i] = E4m3Encode(k[i] / scale);
  std::memcpy(scale_at, &scale, 4);
}

void DecodeIndexerKey(const uint8_t* page, int entries, int index, float* k) {
  const uint8_t* data = page + static_cast<size_t>(index) * kIndexDim;
  const uint8_t* scale_at = page + static_cast<size_t>(entries) * kIndexDim +
                            static_cast<size_t>(index) * kIndexScaleBytes;
  float scale;
  std::memcpy(&scale, scale_at, 4);
  for (int i = 0; i < kIndexDim; ++i) k[i] = E4m3Decode(data[i]) * scale;
}

}  // namespace dsv4
