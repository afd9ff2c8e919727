// Stop strings (the `stop` parameter) over a stream of byte tokens. Text that might be the start
// of a stop string is held back until it is known not to be, so a streamed answer never shows a
// stop string (or part of one) that the whole answer would not: as OpenAI's API, the output
// ends before the first stop string and the stop string itself is not returned.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_STOP_STRINGS_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_STOP_STRINGS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4::serve {

class StopMatcher {
 public:
  StopMatcher() = default;
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Takes the next generated token (`text`: its bytes, empty for BOS/EOS) and returns the
  // tokens now safe to release. After a match (stopped()), the tokens from the stop string on
  // are dropped and every later call returns nothing. `may_stop` false (fewer than min_tokens
  // tokens so far): a complete stop string does not end the output yet; a tail that may
  // become one is still held back.
  std::vector<int32_t> Feed(int32_t token, const std::string& text, bool may_stop = true);
  // The tokens still held back (the generation ended for another reason).
  std::vector<int32_t> Flush();
  bool stopped() const { return stopped_; }

 private:
  // Releases the held tokens whose text lies within the first `chars` held bytes (zero-byte
  // tokens there included).
  std::vector<int32_t> Release(size_t chars);

  std::vector<std::string> stops_;
  std::vector<int32_t> held_;
  std::vector<size_t> held_bytes_;  // text bytes of each held token
  std::string held_text_;
  bool stopped_ = false;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_STOP_STRINGS_H_
