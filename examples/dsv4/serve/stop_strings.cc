#include "examples/dsv4/serve/stop_strings.h"

#include <algorithm>

namespace dsv4::serve {

std::vector<int32_t> StopMatcher::Release(size_t chars) {
  std::vector<int32_t> out;
  size_t i = 0, used = 0;
  while (i < held_.size() && used + held_bytes_[i] <= chars) {
    used += held_bytes_[i];
    out.push_back(held_[i]);
    ++i;
  }
  held_.erase(held_.begin(), held_.begin() + static_cast<std::ptrdiff_t>(i));
  held_bytes_.erase(held_bytes_.begin(), held_bytes_.begin() + static_cast<std::ptrdiff_t>(i));
  held_text_.erase(0, used);
  return out;
}

std::vector<int32_t> StopMatcher::Feed(int32_t token, const std::string& text, bool may_stop) {
  if (stopped_) return {};
  held_.push_back(token);
  held_bytes_.push_back(text.size());
  held_text_ += text;
  if (stops_.empty()) return Release(held_text_.size());
  // The earliest complete stop string ends the output before it.
  size_t first = std::string::npos;
  for (const std::string& s : stops_) {
    if (may_stop) first = std::min(first, held_text_.find(s));
  }
  if (first != std::string::npos) {
    std::vector<int32_t> out = Release(first);
    held_.clear();
    held_bytes_.clear();
    held_text_.clear();
    stopped_ = true;
    return out;
  }
  // Hold back the longest tail that could still become a stop string.
  size_t keep = 0;
  for (const std::string& s : stops_) {
    const size_t most = std::min(s.size() - 1, held_text_.size());
    for (size_t k = most; k > keep; --k) {
      if (held_text_.compare(held_text_.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
    }
  }
  return Release(held_text_.size() - keep);
}

std::vector<int32_t> StopMatcher::Flush() {
  std::vector<int32_t> out = held_;
  held_.clear();
  held_bytes_.clear();
  held_text_.clear();
  return out;
}

}  // namespace dsv4::serve
