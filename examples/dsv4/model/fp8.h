// fp8 e4m3 (the "fn" variant: no infinities, max 448), UE8M0 power-of-two scales, bf16, and
// the DeepSeek-V4 cache records built from them:
//  - KV record (584 B): 448 NoPE dims as fp8 in 7 tiles of 64 with one UE8M0 scale each,
//    then 64 RoPE dims as bf16 (576 data bytes), and 7 scale bytes + 1 pad. Inside a page
//    the 576-byte data rows of all entries come first, then their 8-byte scale rows.
//  - indexer key (132 B): 128 fp8 dims with one fp32 scale; data rows first, then scales.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_FP8_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_FP8_H_

#include <cstdint>

namespace dsv4 {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr int kKvDim = 512;
inline constexpr int kNopeDim = 448;
inline constexpr int kRopeDim = 64;
inline constexpr int kFp8Tile = 64;
inline constexpr int kNopeTiles = kNopeDim / kFp8Tile;            // 7
inline constexpr int kRecordDataBytes = kNopeDim + 2 * kRopeDim;  // 576
inline constexpr int kRecordScaleBytes = 8;                       // 7 scales + 1 pad
inline constexpr int kIndexDim = 128;
inline constexpr int kIndexScaleBytes = 4;

// Round-to-nearest-even, saturating to +-448; NaN encodes as 0x7F.
uint8_t E4m3Encode(float v);
float E4m3Decode(uint8_t b);
// UE8M0: value 2^(e - 127). Encode takes a power of two (the exponent is taken as is).
uint8_t Ue8m0Encode(float power_of_two);
float Ue8m0Decode(uint8_t e);
// The smallest power of two s with amax / s <= 448 (amax clamped below at 1e-4).
float Ue8m0ScaleFor(float amax);
uint16_t Bf16Encode(float v);  // round-to-nearest-even
float Bf16Decode(uint16_t b);

// Record `index` of a page holding `entries` records.
void EncodeKvRecord(const float* kv, uint8_t* page, int entries, int index);
void DecodeKvRecord(const uint8_t* page, int entries, int index, float* kv);
// Indexer key `index` of a page holding `entries` keys; scale = amax / 448 (fp32).
void EncodeIndexerKey(const float* k, uint8_t* page, int entries, int index);
void DecodeIndexerKey(const uint8_t* page, int entries, int index, float* k);

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_FP8_H_
