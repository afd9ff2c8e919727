#include "src/gpu/kv_record_cpu.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvwire::gpu {

void EncodeKvRecordCpu(const float* src, uint8_t* data_row, uint8_t* scale_row) {
  for (uint32_t t = 0; t < kKvTiles; ++t) {
    const float* tile = src + t * kKvTileDims;
    uint32_t amax = 0;
    for (uint32_t j = 0; j < kKvTileDims; ++j) amax = std::max(amax, AbsBits(tile[j]));
    const uint8_t scale = ScaleByteForAmax(amax);
    for (uint32_t j = 0; j < kKvTileDims; ++j) {
      data_row[t * kKvTileDims + j] = EncodeNope(tile[j], scale);
    }
    scale_row[t] = scale;
  }
  scale_row[kKvTiles] = 0;
  for (uint32_t j = 0; j < kKvRopeDims; ++j) {
    const uint16_t v = FloatToBf16(src[kKvNopeDims + j]);
    data_row[kKvNopeDims + 2 * j] = static_cast<uint8_t>(v & 0xff);
    data_row[kKvNopeDims + 2 * j + 1] = static_cast<uint8_t>(v >> 8);
  }
}

void DecodeKvRecordCpu(const uint8_t* data_row, const uint8_t* scale_row, float* out) {
  for (uint32_t t = 0; t < kKvTiles; ++t) {
    const float scale = ScaleValue(scale_row[t]);
    for (uint32_t j = 0; j < kKvTileDims; ++j) {
      out[t * kKvTileDims + j] = E4m3ToFloat(data_row[t * kKvTileDims + j]) * scale;
    }
  }
  for (uint32_t j = 0; j < kKvRopeDims; ++j) {
    const uint16_t v = static_cast<uint16_t>(data_row[kKvNopeDims + 2 * j] |
                                             (data_row[kKvNopeDims + 2 * j + 1] << 8));
    out[kKvNopeDims + j] = Bf16ToFloat(v);
  }
}

absl::Status ValidateKvEncodeArgs(const KvEncodeArgs& args) {
  if (args.num_tokens == 0) return absl::OkStatus();
  if (args.src == nullptr || args.slots == nullptr || args.cache == nullptr) {
    return absl::InvalidArgumentError("kv encode: src, slots and cache must be set");
  }
  if (args.src_stride < kKvInputDims) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv encode: src_stride ", args.src_stride, " < ", kKvInputDims));
  }
  if (args.block_size == 0) return absl::InvalidArgumentError("kv encode: block_size is 0");
  if (args.num_slots == 0) return absl::InvalidArgumentError("kv encode: num_slots is 0");
  if (args.page_bytes < uint64_t{args.block_size} * kKvRecordBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv encode: page_bytes ", args.page_bytes,
                                                   " < block_size ", args.block_size, " x ",
                                                   kKvRecordBytes));
  }
  return absl::OkStatus();
}

absl::Status EncodeKvRecordsCpu(const KvEncodeArgs& args) {
  if (absl::Status s = ValidateKvEncodeArgs(args); !s.ok()) return s;
  for (uint32_t i = 0; i < args.num_tokens; ++i) {
    if (args.slots[i] >= 0 && static_cast<uint64_t>(args.slots[i]) >= args.num_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv encode: token ", i, " slot ", args.slots[i], " >= ", args.num_slots));
    }
  }
  for (uint32_t i = 0; i < args.num_tokens; ++i) {
    if (args.slots[i] < 0) continue;
    const uint64_t slot = static_cast<uint64_t>(args.slots[i]);
    uint8_t* page = args.cache + slot / args.block_size * args.page_bytes;
    const uint64_t entry = slot % args.block_size;
    EncodeKvRecordCpu(args.src + i * args.src_stride, page + KvDataRowOffset(entry),
                      page + KvScaleRowOffset(args.block_size, entry));
  }
  return absl::OkStatus();
}

}  // namespace kvwire::gpu
