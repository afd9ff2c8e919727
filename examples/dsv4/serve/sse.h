// Server-sent events as the OpenAI completions API streams them: "data: <json>\n\n" events
// ending with "data: [DONE]\n\n". The parser takes bytes in any pieces.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_SSE_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_SSE_H_

#include <string>
#include <string_view>
#include <vector>

namespace dsv4::serve {

class SseParser {
 public:
  // Returns the data of every event completed by `bytes` (multi-line data joined by '\n';
  // comments and other fields are skipped).
  std::vector<std::string> Feed(std::string_view bytes);
  // Bytes of an unfinished event.
  size_t pending() const { return buffer_.size(); }

 private:
  std::string buffer_;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_SSE_H_
