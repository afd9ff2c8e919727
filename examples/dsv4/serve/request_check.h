// What a model server refuses at once (400) in a request that parsed: its length against the
// model's context, its logprobs against --max-logprobs, and its kv_transfer_params against
// the server's role (a prefill's request to a decode, the other way round, a prepare that is
// not write mode, n > 1 on one hand-off).
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_REQUEST_CHECK_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_REQUEST_CHECK_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

#include "examples/dsv4/serve/completion_api.h"

namespace dsv4::serve {

struct ServerLimits {
  std::string role;  // prefill | decode | both
  int max_seq_len = 0;
  int vocab_size = 0;
  int64_t max_logprobs = kDefaultMaxLogprobs;  // -1: the vocabulary
};

// How many tokens the request's prompt runs (token ids as given, or BOS and the bytes of its
// text), without encoding it.
uint64_t PromptTokenCount(const CompletionRequest& req);

// `prepare`: the request came to /v1/kv/prepare.
absl::Status CheckRequest(const CompletionRequest& req, bool prepare, const ServerLimits& limits);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_REQUEST_CHECK_H_
