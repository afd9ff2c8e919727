// Byte-level tokenizer: token = byte value (0..255), then BOS and EOS.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_TOKENIZER_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_TOKENIZER_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

inline constexpr int32_t kBosToken = 256;
inline constexpr int32_t kEosToken = 257;
inline constexpr int32_t kByteVocab = 258;

// BOS followed by the bytes of `text`.
std::vector<int32_t> Encode(std::string_view text);
// Bytes of the byte tokens; BOS/EOS and out-of-range ids are dropped.
std::string Decode(std::span<const int32_t> tokens);

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_TOKENIZER_H_
