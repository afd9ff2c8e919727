// The model server's decode role (worker thread): allocates blocks and loads a prefill's KV
// through the connector (POST /v1/kv/prepare first in write mode), then reruns the last
// prompt token over the KV that moved for the first token's logits.
#include <algorithm>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/handoff_release.h"
#include "examples/dsv4/serve/model_server_impl.h"
#include "examples/dsv4/serve/transfer_report.h"
#include "src/util/json_fields.h"
#include "src/util/log.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;

// Allocates and starts the load of a remote-prefill request; false (answered) on error.
bool ModelServer::Impl::StartLoad(Active& a, const std::shared_ptr<Responder>& resp) {
  json kvp = a.req.kv_transfer_params;  // an object: do_remote_prefill is set
  const KvTransferFields& kv = a.req.kv;
  const uint64_t n = a.prompt.size();
  if (kv.num_tokens == 0) kvp["num_tokens"] = n;
  if (kv.num_tokens != 0 && kv.num_tokens != n) {
    const std::string m = absl::StrCat("kv_transfer_params.num_tokens ", kv.num_tokens,
                                       " does not match the prompt's ", n, " tokens");
    ReleaseHandOff(a.req, m);
    Fail(resp, 400, m);
    return false;
  }
  a.transfer_id = kv.transfer_id;
  // Named by engine id alone (discovery): the connector resolves it through etcd.
  if (kv.remote_host.empty()) {
    kvwire::JsonFields f(kvp, "kv_transfer_params");
    a.peer = f.Has("remote_engine_id") ? f.OptString("remote_engine_id", "", kMaxIdBytes)
                                       : f.OptString("engine_id", "", kMaxIdBytes);
  } else {
    a.peer = absl::StrCat(kv.remote_host, ":", kv.remote_port);
  }
  absl::StatusOr<kvwire::MatchResult> m =
      connector_->GetNumNewMatchedTokens(a.id, KvTokens(n), 0, Dump(kvp));
  if (!m.ok()) {
    Fail(resp, 400, std::string(m.status().message()));
    return false;
  }
  absl::StatusOr<kvwire::BlockTable> blocks = cache_->Allocate(n);
  if (!blocks.ok()) {
    (void)connector_->RequestFinished(a.id, {}, n, "", /*aborted=*/true);
    Fail(resp, 503, absl::StrCat("out of KV blocks: ", blocks.status().message()));
    return false;
  }
  a.blocks = std::move(*blocks);
  absl::Status s = connector_->UpdateStateAfterAlloc(a.id, a.blocks, m->num_external_tokens);
  if (s.ok()) s = connector_->BindConnectorMeta(connector_->BuildConnectorMeta());
  if (!s.ok()) {
    (void)connector_->RequestFinished(a.id, a.blocks, n, "", /*aborted=*/true);
    cache_->Free(a.blocks);
    Fail(resp, 500, std::string(s.message()));
    return false;
  }
  a.loading = true;
  a.remote = true;
  a.load_start = absl::Now();
  // Connects (first request to this prefill) and issues the READs or the write request.
  (void)connector_->StartLoadKv();
  return true;
}

void ModelServer::Impl::Prepare(Job& job) {
  const std::string& tid = job.req.kv.transfer_id;  // Check: not empty
  if (prepared_.count(tid) != 0) {
    return Fail(job.resp, 409, absl::StrCat("transfer_id ", tid, " is already prepared"));
  }
  Active a;
  a.id = NewId();
  a.req = job.req;
  a.prompt = PromptTokens(job.req);
  a.arrived = job.arrived;
  a.deadline = absl::Now() + options_.request_timeout;
  if (!StartLoad(a, job.resp)) return;
  prepared_[tid] = a.id;
  json out = {{"request_id", a.id}, {"transfer_id", tid}, {"num_tokens", a.prompt.size()}};
  const std::string id = a.id;
  active_.emplace(id, std::move(a));
  job.resp->Respond(200, out.dump());
}

void ModelServer::Impl::StartDecode(Job& job) {
  const std::string& tid = job.req.kv.transfer_id;
  auto p = job.req.kv.mode == "write" ? prepared_.find(tid) : prepared_.end();
  if (p != prepared_.end()) {
    // Claims the prepared request: its load may be done already.
    Active& a = active_.at(p->second);
    prepared_.erase(p);
    if (a.aborting || a.load_failed) {
      // Cancelled (never claimed in time, or its load failed) before this claim came: its
      // blocks are on their way back; say why rather than drop the claim.
      return Fail(job.resp, 504,
                  absl::StrCat("the KV transfer prepared for transfer_id ", tid,
                               " ended before it was claimed: ", a.load_error));
    }
    if (PromptTokens(job.req) != a.prompt) {
      Cancel(a, "prompt differs from the prepared one");
      return Fail(job.resp, 400, "prompt differs from the one prepared for this transfer_id");
    }
    if (job.req.max_tokens > a.req.max_tokens) {
      // The reservation made at prepare time grows: admitted only if the cache can hold it.
      const uint64_t n = a.prompt.size();
      const BlockCounts old = BlocksNeeded(cache_->layout(), n + a.req.max_tokens);
      BlockCounts extra = BlocksNeeded(cache_->layout(), n + job.req.max_tokens);
      for (auto& [group, count] : extra) count -= old.at(group);
      if (std::string s = Shortfall(extra, Available()); !s.empty()) {
        Cancel(a, "max_tokens grew past what the KV cache can hold");
        return Overloaded(job.resp, absl::StrCat("max_tokens ", job.req.max_tokens,
                                                 " is more than the ", a.req.max_tokens,
                                                 " this transfer was prepared for, and the KV "
                                                 "cache cannot hold the difference now (",
                                                 s, ")"));
      }
    }
    a.req = job.req;
    InitSampling(a);
    a.resp = job.resp;
    a.claimed = absl::Now();
    a.deadline = a.claimed + options_.request_timeout;
    return;
  }
  Active a = ActiveFrom(job);
  if (!StartLoad(a, a.resp)) return;
  const std::string id = a.id;
  active_.emplace(id, std::move(a));
}

// Decode: the KV is in place; the first token (prefill's) goes out.
void ModelServer::Impl::Loaded(Active& a) {
  const absl::Time waited_from = std::max(a.claimed, a.load_start);
  const double wait_ms = a.load_end > waited_from ? Ms(a.load_end - waited_from) : 0.0;
  load_wait_us_ += static_cast<uint64_t>(wait_ms * 1000);
  a.transfer = TransferJson(*connector_, a.id, a.transfer_id, a.peer);
  a.transfer["load_wait_ms"] = wait_ms;
  if (a.transfer.value("mode", "") == "write") {
    // The transfer overlaps prefill's compute: what counts is the tail after its last layer.
    AddWriteModeTransfer(cache_->layout(), a.blocks, KvTokens(a.prompt.size()),
                         a.req.prefill_computed_unix_us, a.load_end, a.transfer);
  }
  if (options_.corrupt_kv_page) {
    // The last page that moved (the last prompt token's may not have).
    a.corrupted = CorruptLastMovedSwaPage(*cache_, a.blocks, KvTokens(a.prompt.size()), a.id);
  }
  a.decode_start = absl::Now();
  // The last prompt token again, over the KV that moved: its logits give the first token.
  const uint64_t last = a.prompt.size() - 1;
  absl::StatusOr<std::vector<float>> logits =
      model_->Forward(*cache_, a.blocks, std::span<const int32_t>(&a.prompt[last], 1), last);
  if (!logits.ok()) {
    Fail(a.resp, 500, absl::StrCat("decode failed: ", logits.status().message()));
    a.resp.reset();
    return Finish(a);
  }
  Emit(a, a.sampler->Next(*logits, a.out));
}

}  // namespace dsv4::serve
