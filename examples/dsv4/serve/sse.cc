#include "examples/dsv4/serve/sse.h"

namespace dsv4::serve {

std::vector<std::string> SseParser::Feed(std::string_view bytes) {
  buffer_.append(bytes);
  std::vector<std::string> events;
  while (true) {
    // Events end with a blank line; accept "\r\n" line ends too.
    size_t end = buffer_.find("\n\n");
    size_t skip = 2;
    const size_t crlf = buffer_.find("\r\n\r\n");
    if (crlf != std::string::npos && (end == std::string::npos || crlf < end)) {
      end = crlf;
      skip = 4;
    }
    if (end == std::string::npos) break;
    const std::string event = buffer_.substr(0, end);
    buffer_.erase(0, end + skip);
    std::string data;
    bool have = false;
    size_t pos = 0;
    while (pos <= event.size()) {
      size_t nl = event.find('\n', pos);
      if (nl == std::string::npos) nl = event.size();
      std::string line = event.substr(pos, nl - pos);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      pos = nl + 1;
      if (line.rfind("data:", 0) != 0) continue;
      std::string value = line.substr(5);
      if (!value.empty() && value[0] == ' ') value.erase(0, 1);
      if (have) data += '\n';
      data += value;
      have = true;
    }
    if (have) events.push_back(std::move(data));
  }
  return events;
}

}  // namespace dsv4::serve
