// The model server's prefill role (worker thread): runs the prompt, samples the first token,
// and hands the KV off (read mode: held for decode's reader; write mode: each layer streamed
// to the decode's blocks as it is computed).
#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/model_server_impl.h"
#include "src/util/log.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;

void ModelServer::Impl::RunPrefill(Job& job) {
  struct Busy {  // /health shows a prefill in progress
    explicit Busy(std::atomic<int>& n) : n_(n) { ++n_; }
    ~Busy() { --n_; }
    std::atomic<int>& n_;
  } busy(prefilling_);
  CompletionRequest& req = job.req;
  const std::vector<int32_t> tokens = PromptTokens(req);
  const uint64_t n = tokens.size();
  json kvp = req.kv_transfer_params;  // an object: do_remote_decode is set
  std::string mode = req.kv.mode.empty() ? "auto" : req.kv.mode;
  if (mode == "auto") mode = options_.mode == "write" ? "write" : "read";
  kvp["mode"] = mode;
  kvp["do_remote_decode"] = true;
  const bool write = mode == "write";
  if (mode != "read" && mode != "write") {
    return Fail(job.resp, 400, absl::StrCat("kv_transfer_params.mode '", mode, "' is unknown"));
  }
  if (write && req.kv.transfer_id.empty()) {
    return Fail(job.resp, 400, "write mode needs kv_transfer_params.transfer_id");
  }
  const std::string id = NewId();
  absl::StatusOr<kvwire::BlockTable> blocks = cache_->Allocate(n);
  if (!blocks.ok()) {
    return Fail(job.resp, 503, absl::StrCat("out of KV blocks: ", blocks.status().message()));
  }
  const std::string params = Dump(kvp);
  if (write) {
    absl::StatusOr<kvwire::MatchResult> m =
        connector_->GetNumNewMatchedTokens(id, KvTokens(n), 0, params);
    absl::Status s = m.status();
    if (s.ok()) s = connector_->UpdateStateAfterAlloc(id, *blocks, 0);
    if (s.ok()) s = connector_->BindConnectorMeta(connector_->BuildConnectorMeta());
    if (!s.ok()) {
      Release(id, *blocks, KvTokens(n), params);
      return Fail(job.resp, absl::IsFailedPrecondition(s) ? 409 : 400, std::string(s.message()));
    }
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<float>> logits =
      model_->Forward(*cache_, *blocks, tokens, 0, [&](int layer) {
        if (write) (void)connector_->SaveKvLayer(layer);
        Delay();
      });
  const absl::Time computed = absl::Now();
  if (!logits.ok()) {
    Release(id, *blocks, write ? KvTokens(n) : n, write ? params : "", /*aborted=*/true);
    return Fail(job.resp, 500, absl::StrCat("prefill failed: ", logits.status().message()));
  }
  if (write) (void)connector_->WaitForSave();
  // Decode samples the client's tokens (this one is not shown): any seed gives a token.
  const int32_t first = Sampler(req.sampling, req.sampling.seed.value_or(0), tokens, kEosToken)
                            .Next(*logits, {})
                            .token;
  absl::StatusOr<kvwire::RequestFinishedResult> rf =
      connector_->RequestFinished(id, *blocks, write ? KvTokens(n) : n, params);
  if (!rf.ok()) {
    cache_->Free(*blocks);
    return Fail(job.resp, absl::IsFailedPrecondition(rf.status()) ? 409 : 500,
                std::string(rf.status().message()));
  }
  if (rf->delay_free) {
    held_[id] = std::move(*blocks);
  } else {
    cache_->Free(*blocks);
  }
  // /health shows the hand-off before the answer goes out (the loop updates these only
  // after this iteration: a client that asks at once saw none).
  held_count_.store(static_cast<int>(held_.size()));
  held_blocks_.store(HeldBlocks());
  const double prefill_ms = Ms(computed - start);
  prefill_us_ += static_cast<uint64_t>(prefill_ms * 1000);
  prompt_tokens_ += n;
  generated_tokens_ += 1;
  ++requests_ok_;
  json out = ResponseJson(req.endpoint, /*chunk=*/false, false, id, config_.name,
                          Decode(std::vector<int32_t>{first}), {first},
                          first == kEosToken ? "stop" : "length");
  out["usage"] = {{"prompt_tokens", n}, {"completion_tokens", 1}, {"total_tokens", n + 1}};
  if (write) {
    out["kv_transfer_params"] = kvp;
  } else {
    out["kv_transfer_params"] = json::parse(rf->kv_transfer_params, nullptr, false);
  }
  out["kvwire"] = {{"role", "prefill"},
                   {"engine_id", connector_->engine_id()},
                   {"mode", mode},
                   {"prompt_tokens", n},
                   {"prefill_ms", prefill_ms},
                   {"prefill_tokens_per_s", n / std::max(1e-9, prefill_ms / 1e3)},
                   {"queue_ms", Ms(start - job.arrived)},
                   {"computed_unix_us", absl::ToUnixMicros(computed)}};
  job.resp->Respond(200, Dump(out));
}

// A failed prefill request: tells the connector and gives the blocks back (now, or when
// the connector reports that nothing touches them any more).
void ModelServer::Impl::Release(const std::string& id, kvwire::BlockTable& blocks, uint64_t n,
                                const std::string& params, bool aborted) {
  absl::StatusOr<kvwire::RequestFinishedResult> rf =
      connector_->RequestFinished(id, blocks, n, params, aborted);
  if (rf.ok() && rf->delay_free) {
    held_[id] = std::move(blocks);
  } else {
    cache_->Free(blocks);
  }
}

}  // namespace dsv4::serve
