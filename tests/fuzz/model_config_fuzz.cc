// The model config (examples/dsv4/model/config.cc): read from the config.json an operator
// points the server at. A config that parses is what the model and the connector size their
// memory from, so its cache layout must validate.
#include <cstddef>
#include <cstdint>
#include <string>

#include "examples/dsv4/model/config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<dsv4::Config> config = dsv4::Config::FromJson(text);
  if (!config.ok()) {
    KVWIRE_FUZZ_CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  const kvwire::Layout layout = config->CacheLayout();
  for (const kvwire::CacheGroup& g : layout.groups) {
    KVWIRE_FUZZ_CHECK(g.tokens_per_block > 0 && g.page_bytes > 0);
  }
  return 0;
}
