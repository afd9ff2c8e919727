#include "examples/dsv4/serve/request_check.h"

#include "absl/strings/str_cat.h"

namespace dsv4::serve {

uint64_t PromptTokenCount(const CompletionRequest& req) {
  return req.prompt_ids ? req.prompt_ids->size() : req.prompt.size() + 1;  // BOS + bytes
}

absl::Status CheckRequest(const CompletionRequest& req, bool prepare, const ServerLimits& limits) {
  const KvTransferFields& kv = req.kv;
  const bool remote_decode = kv.do_remote_decode;
  const bool remote_prefill = kv.do_remote_prefill;
  const uint64_t n = PromptTokenCount(req);
  if (n + req.max_tokens > static_cast<uint64_t>(limits.max_seq_len)) {
    return absl::InvalidArgumentError(absl::StrCat("prompt (", n, " tokens) + max_tokens (",
                                                   req.max_tokens, ") exceeds max_seq_len ",
                                                   limits.max_seq_len));
  }
  if (req.sampling.n > 1 && (remote_prefill || prepare)) {
    return absl::InvalidArgumentError(
        "request body: 'n' > 1 cannot load one prefill's KV more than once (an aggregated "
        "server or the router runs each choice on its own)");
  }
  if (req.sampling.logprobs) {
    const int64_t vocab = limits.vocab_size;
    const int64_t want = *req.sampling.logprobs < 0 ? vocab : *req.sampling.logprobs;
    const int64_t most = limits.max_logprobs < 0 ? vocab : limits.max_logprobs;
    if (want > most) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request body: '", req.endpoint == Endpoint::kChat ? "top_logprobs" : "logprobs",
          "' asks for ", want, " logprobs, more than this server's --max-logprobs (", most, ")"));
    }
  }
  if (remote_decode && remote_prefill) {
    return absl::InvalidArgumentError(
        "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive");
  }
  if (remote_decode && limits.role == "decode") {
    return absl::InvalidArgumentError(
        "this is a decode server: do_remote_decode requests go to a prefill server");
  }
  if ((remote_prefill || prepare) && limits.role == "prefill") {
    return absl::InvalidArgumentError(
        "this is a prefill server: do_remote_prefill requests go to a decode server");
  }
  if (prepare && (!remote_prefill || kv.mode != "write" || kv.transfer_id.empty())) {
    return absl::InvalidArgumentError(
        "/v1/kv/prepare needs kv_transfer_params with do_remote_prefill, mode \"write\" "
        "and a transfer_id");
  }
  return absl::OkStatus();
}

}  // namespace dsv4::serve
