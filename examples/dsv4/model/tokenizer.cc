// Byte-level tokenizer.
#include "examples/dsv4/model/tokenizer.h"

namespace dsv4 {

std::vector<int32_t> Encode(std::string_view text) {
  std::vector<int32_t> out;
  out.reserve(text.size() + 1);
  out.push_back(kBosToken);
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
  return out;
}

std::string Decode(std::span<const int32_t> tokens) {
  std::string out;
  out.reserve(tokens.size());
  for (int32_t t : tokens) {
    if (t >= 0 && t < 256) out.push_back(static_cast<char>(t));
  }
  return out;
}

}  // namespace dsv4
