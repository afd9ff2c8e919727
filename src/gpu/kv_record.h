// The DeepSeek-V4 fp8 KV record, shared by the CPU reference and the GPU kernels: one
// 512-dim vector per token or compressed entry becomes 584 bytes
//
//   data row  (576 B): 448 fp8 e4m3 NoPE values (7 tiles of 64) | 64 bf16 RoPE values (LE)
//   scale row (  8 B): 7 UE8M0 scale bytes (one per tile)       | 1 pad byte (0)
//
// and a page of `block_size` entries holds all data rows first, then all scale rows, rounded up
// to a multiple of 576 bytes (kvwire::Dsv4PageBytes). Every conversion below is integer bit
// arithmetic, apart from one multiply by an exact power of two, so the CPU and the GPU produce
// the same bytes by construction (no dependence on the device's rounding modes, fast-math or
// denormal flushing). This header is plain C++17 so nvcc and hipcc compile it too.
#ifndef KVWIRE_GPU_KV_RECORD_H_
#define KVWIRE_GPU_KV_RECORD_H_

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVW_HOST_DEVICE __host__ __device__
#else
#define KVW_HOST_DEVICE
#endif

namespace kvwire::gpu {

inline constexpr uint32_t kKvNopeDims = 448;
inline constexpr uint32_t kKvRopeDims = 64;
inline constexpr uint32_t kKvInputDims = kKvNopeDims + kKvRopeDims;  // 512
inline constexpr uint32_t kKvTileDims = 64;
inline constexpr uint32_t kKvTiles = kKvNopeDims / kKvTileDims;                 // 7
inline constexpr uint32_t kKvDataRowBytes = kKvNopeDims + 2 * kKvRopeDims;      // 576
inline constexpr uint32_t kKvScaleRowBytes = kKvTiles + 1;                      // 8
inline constexpr uint32_t kKvRecordBytes = kKvDataRowBytes + kKvScaleRowBytes;  // 584
// Largest finite e4m3 (OCP E4M3FN: no infinities, 0x7f / 0xff are NaN).
inline constexpr float kE4m3Max = 448.0f;
// UE8M0 scale bytes are clamped to this range. 105 (2^-22) is the scale of amax = 1e-4: a tile
// whose largest |x| is smaller counts as 1e-4, as in the reference engine's encoder
// (examples/dsv4/model/fp8.cc), so that tiles of (near) zeros keep a finite scale. 247 is the
// scale of FLT_MAX / 448 rounded up.
inline constexpr uint32_t kMinScaleByte = 105;
inline constexpr uint32_t kMaxScaleByte = 247;

// Page bytes for `block_size` records: data rows, then scale rows, rounded up to 576.
inline constexpr uint64_t KvPageBytes(uint64_t block_size) {
  return (block_size * kKvRecordBytes + kKvDataRowBytes - 1) / kKvDataRowBytes * kKvDataRowBytes;
}
KVW_HOST_DEVICE inline uint64_t KvDataRowOffset(uint64_t entry) { return entry * kKvDataRowBytes; }
KVW_HOST_DEVICE inline uint64_t KvScaleRowOffset(uint64_t block_size, uint64_t entry) {
  return block_size * kKvDataRowBytes + entry * kKvScaleRowBytes;
}

KVW_HOST_DEVICE inline uint32_t FloatBits(float f) {
  uint32_t b;
  __builtin_memcpy(&b, &f, sizeof b);
  return b;
}
KVW_HOST_DEVICE inline float BitsFloat(uint32_t b) {
  float f;
  __builtin_memcpy(&f, &b, sizeof f);
  return f;
}

// |x| as bits: non-negative floats order like their bit patterns, so the tile maximum is an
// integer max (associative, exact, the same in any reduction order). A NaN counts as 0
// (std::max(amax, |NaN|) in the reference engine keeps amax too).
KVW_HOST_DEVICE inline uint32_t AbsBits(float f) {
  const uint32_t a = FloatBits(f) & 0x7fffffffu;
  return a > 0x7f800000u ? 0 : a;
}

// The UE8M0 scale byte (scale = 2^(byte-127)) of a tile whose largest |x| has bits
// `amax_bits`: the smallest power of two with 448 * scale >= amax. With amax = m * 2^E
// (1 <= m < 2) and 448 = 1.75 * 2^8 that is 2^(E-8) when m <= 1.75, else 2^(E-7).
KVW_HOST_DEVICE inline uint8_t ScaleByteForAmax(uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u) amax_bits = 0x7f7fffffu;  // inf / NaN: as FLT_MAX
  const int biased = static_cast<int>(amax_bits >> 23);
  int byte = biased - 8 + ((amax_bits & 0x7fffffu) > 0x600000u ? 1 : 0);
  if (biased == 0 || byte < static_cast<int>(kMinScaleByte)) byte = kMinScaleByte;
  if (byte > static_cast<int>(kMaxScaleByte)) byte = kMaxScaleByte;
  return static_cast<uint8_t>(byte);
}
// 2^(127-byte), always a normal float for bytes in [kMinScaleByte, kMaxScaleByte].
KVW_HOST_DEVICE inline float InverseScale(uint8_t byte) {
  return BitsFloat(static_cast<uint32_t>(254 - byte) << 23);
}
KVW_HOST_DEVICE inline float ScaleValue(uint8_t byte) {
  return BitsFloat(static_cast<uint32_t>(byte) << 23);
}

// fp32 -> fp8 e4m3 (OCP E4M3FN, bias 7), round to nearest even, saturating to +-448; NaN ->
// 0x7f with the sign. Float denormals and values below half the smallest e4m3 subnormal
// (2^-10) become a signed zero, so flushing denormals on a device changes nothing.
KVW_HOST_DEVICE inline uint8_t FloatToE4m3(float f) {
  const uint32_t b = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;
  if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448 (and +-inf)
  if ((a >> 23) == 0) return sign;           // zero or float denormal
  const int exp = static_cast<int>(a >> 23) - 127;
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  if (exp < -6) {
    // e4m3 subnormal: value / 2^-9 = mant * 2^(exp - 14).
    const int shift = 14 - exp;
    if (shift >= 25) return sign;  // below 2^-10 (or a tie at it rounding to even 0)
    const uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    const uint32_t r = q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0);
    return sign | static_cast<uint8_t>(r);  // r == 8 encodes 2^-6, the smallest normal
  }
  uint32_t m3 = (a >> 20) & 7u;
  const uint32_t rem = a & 0xfffffu;
  int biased = exp + 7;
  if (rem > 0x80000u || (rem == 0x80000u && (m3 & 1))) {
    if (++m3 == 8) {
      m3 = 0;
      ++biased;
    }
  }
  if (biased > 15 || (biased == 15 && m3 == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((biased << 3) | m3);
}

KVW_HOST_DEVICE inline float E4m3ToFloat(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80) << 24;
  const uint32_t e = (v >> 3) & 15u;
  const uint32_t m = v & 7u;
  if (e == 15 && m == 7) return BitsFloat(sign | 0x7fc00000u);
  if (e == 0) {
    // m * 2^-9, exactly representable.
    const float mag = static_cast<float>(m) * BitsFloat((127u - 9u) << 23);
    return sign ? -mag : mag;
  }
  return BitsFloat(sign | ((e - 7 + 127) << 23) | (m << 20));
}

// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
KVW_HOST_DEVICE inline uint16_t FloatToBf16(float f) {
  const uint32_t b = FloatBits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
KVW_HOST_DEVICE inline float Bf16ToFloat(uint16_t v) {
  return BitsFloat(static_cast<uint32_t>(v) << 16);
}

// One NoPE value of a tile whose scale byte is `scale_byte`.
KVW_HOST_DEVICE inline uint8_t EncodeNope(float x, uint8_t scale_byte) {
  return FloatToE4m3(x * InverseScale(scale_byte));
}

// One KV-cache write: token i's 512 floats (448 NoPE then 64 RoPE) at src + i * src_stride go
// to slot slots[i] = block * block_size + offset within the block; a negative slot is skipped
// (padding tokens), as in vLLM's slot_mapping. Slots at or past num_slots (the cache's pages x
// block_size) are refused by the CPU path before it writes anything; the GPU kernel, which
// cannot return an error per token, skips them so that it never writes outside the cache.
struct KvEncodeArgs {
  const float* src = nullptr;
  uint64_t src_stride = kKvInputDims;  // floats between consecutive tokens
  const int64_t* slots = nullptr;
  uint8_t* cache = nullptr;  // page p starts at cache + p * page_bytes
  uint64_t page_bytes = 0;
  uint64_t num_slots = 0;
  uint32_t block_size = 0;
  uint32_t num_tokens = 0;
};

}  // namespace kvwire::gpu

#endif  // KVWIRE_GPU_KV_RECORD_H_
