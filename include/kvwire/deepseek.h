// Layout presets of the DeepSeek family: DeepSeek-V4 (Pro, Flash, or any V4-shaped model
// from its per-layer compress ratios) with its 584-byte fp8 KV record, and DeepSeek-V3/V3.2
// (MLA). Also reachable by name through PresetLayout (kvwire/layout.h).
#ifndef KVWIRE_DEEPSEEK_H_
#define KVWIRE_DEEPSEEK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kvwire/layout.h"

namespace kvwire {

// DeepSeek-V4 fp8 KV record: 448 fp8 NoPE + 64 bf16 RoPE + 7 UE8M0 scales + 1 pad.
inline constexpr uint64_t kDsv4RecordBytes = 584;
inline constexpr uint64_t kDsv4PageAlign = 576;
// Page bytes of `entries` 584-byte records (data rows then scale rows), rounded up to 576.
uint64_t Dsv4PageBytes(uint64_t entries, uint64_t record_bytes = kDsv4RecordBytes);

Layout DeepSeekV4ProLayout();    // 61 layers + 1 MTP layer
Layout DeepSeekV4FlashLayout();  // 43 layers, first two window-only
// Any DeepSeek-V4-shaped model: compress_ratios[layer] is 0 (window only), 4 (c4a) or 128
// (c128a); any other value counts as window only. MTP layers follow, window only. Group
// names: swa_kv, c4a_kv, c128a_kv, c4a_indexer_k, c4a_compressor_state,
// c128a_compressor_state, c4a_indexer_compressor_state (groups with no layers are kept).
Layout DeepSeekV4Layout(std::string model, const std::vector<int>& compress_ratios,
                        int mtp_layers = 0);
// DeepSeek-V3 (MLA, 656-byte fp8 latent) and V3.2 (adds the 132-byte indexer K).
Layout DeepSeekV3Layout(bool with_indexer = false, int tokens_per_block = 64);

}  // namespace kvwire

#endif  // KVWIRE_DEEPSEEK_H_
