// A completions client for the demo and the tests: sends one request (streamed or not) and
// collects the tokens, the final statistics and the time to the first token.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_CLIENT_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_CLIENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dsv4::serve {

struct CompletionResult {
  int status = 0;     // HTTP status
  std::string error;  // error message (non-200, or an error event inside a stream)
  bool done = false;  // a stream ended with [DONE]
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish_reason;
  nlohmann::json kvwire;  // the server's statistics (last chunk / response)
  double ttft_ms = 0;     // time to the first token (stream) or to the response
  double total_ms = 0;
};

// Transport failures (no connection, connection lost, deadline) are errors; HTTP errors
// are results with `status` and `error` set.
absl::StatusOr<CompletionResult> Complete(const std::string& address, const nlohmann::json& request,
                                          absl::Duration timeout);

// GET `path` and parse the JSON body.
absl::StatusOr<nlohmann::json> GetJson(const std::string& address, const std::string& path,
                                       absl::Duration timeout = absl::Seconds(10));

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_CLIENT_H_
