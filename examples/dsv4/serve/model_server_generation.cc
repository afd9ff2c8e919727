// The model server's generation (worker thread): a local request's prefill, one token per
// step for every active request (local or decode), sampling, streaming, the answer, and the
// ends of a request (finish, cancel).
#include <algorithm>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/model_server_impl.h"
#include "src/util/log.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;

ModelServer::Impl::Active ModelServer::Impl::ActiveFrom(const Job& job) {
  Active a;
  a.id = NewId();
  a.req = job.req;
  a.resp = job.resp;
  a.prompt = PromptTokens(job.req);
  InitSampling(a);
  a.arrived = a.claimed = job.arrived;
  a.deadline = absl::Now() + options_.request_timeout;
  return a;
}

void ModelServer::Impl::StartLocal(Job& job) {
  Active a = ActiveFrom(job);
  absl::StatusOr<kvwire::BlockTable> blocks = cache_->Allocate(a.prompt.size());
  if (!blocks.ok()) {
    return Fail(job.resp, 503, absl::StrCat("out of KV blocks: ", blocks.status().message()));
  }
  a.blocks = std::move(*blocks);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<float>> logits =
      model_->Forward(*cache_, a.blocks, a.prompt, 0, [&](int) { Delay(); });
  if (!logits.ok()) {
    cache_->Free(a.blocks);
    return Fail(job.resp, 500, absl::StrCat("prefill failed: ", logits.status().message()));
  }
  a.prefill_ms = Ms(absl::Now() - start);
  prefill_us_ += static_cast<uint64_t>(a.prefill_ms * 1000);
  a.decode_start = absl::Now();
  const std::string id = a.id;
  Active& in = active_.emplace(id, std::move(a)).first->second;
  Emit(in, in.sampler->Next(*logits, in.out));
}

void ModelServer::Impl::Step(Active& a) {
  const int32_t last = a.out.back();
  const uint64_t pos = a.prompt.size() + a.out.size() - 1;
  if (absl::Status s = cache_->Grow(a.blocks, pos + 1); !s.ok()) {
    Fail(a.resp, 503, absl::StrCat("out of KV blocks: ", s.message()));
    a.resp.reset();
    return Finish(a);
  }
  absl::StatusOr<std::vector<float>> logits =
      model_->Forward(*cache_, a.blocks, std::span<const int32_t>(&last, 1), pos);
  if (!logits.ok()) {
    Fail(a.resp, 500, absl::StrCat("decode failed: ", logits.status().message()));
    a.resp.reset();
    return Finish(a);
  }
  Delay();
  Emit(a, a.sampler->Next(*logits, a.out));
}

// The request's sampler (choice 0; a request without a seed draws one now) and output.
void ModelServer::Impl::InitSampling(Active& a) {
  const SamplingParams& p = a.req.sampling;
  a.sampler.emplace(p, p.seed ? *p.seed : RandomSeed(), a.prompt, kEosToken);
  a.output = GenerationOutput(a.req, kEosToken, DecodeTokens,
                              a.req.prompt_ids ? Decode(*a.req.prompt_ids) : a.req.prompt);
}

// Appends a token, streams what the output releases, and completes the request at a stop
// string, EOS (unless ignore_eos) or max_tokens.
void ModelServer::Impl::Emit(Active& a, const Sampled& sampled) {
  a.out.push_back(sampled.token);
  ++generated_tokens_;
  GenerationOutput::Step step = a.output.Feed(sampled);
  const Endpoint endpoint = a.req.endpoint;
  if (a.req.stream && (!step.tokens.empty() || !step.text.empty())) {
    const bool first = !a.resp->streaming();
    if (first) a.resp->StartEvents();
    a.resp->Event(Dump(ResponseJson(endpoint, /*chunk=*/true, first, a.id, config_.name, step.text,
                                    step.tokens, nullptr, step.logprobs)));
  }
  if (!step.done) return;
  const double decode_ms = Ms(absl::Now() - a.decode_start);
  decode_us_ += static_cast<uint64_t>(decode_ms * 1000);
  prompt_tokens_ += a.remote ? 0 : a.prompt.size();
  ++requests_ok_;
  json stats = {{"role", a.remote ? "decode" : "local"},
                {"engine_id", connector_->engine_id()},
                {"decode_ms", decode_ms},
                {"decode_tokens", a.out.size() - 1},
                {"decode_tokens_per_s",
                 a.out.size() > 1 ? (a.out.size() - 1) / std::max(1e-9, decode_ms / 1e3) : 0.0}};
  if (a.remote) {
    stats["transfer"] = a.transfer;
    stats["corrupted_page"] = a.corrupted;
    if (!a.req.prefill_stats.is_null()) stats["prefill"] = a.req.prefill_stats;
  } else {
    stats["prefill_ms"] = a.prefill_ms;
  }
  const uint64_t n = a.prompt.size();
  const json usage = {{"prompt_tokens", n},
                      {"completion_tokens", a.out.size()},
                      {"total_tokens", n + a.out.size()}};
  if (a.req.stream) {
    const bool first = !a.resp->streaming();
    if (first) a.resp->StartEvents();
    json last = ResponseJson(endpoint, /*chunk=*/true, first, a.id, config_.name, "", {},
                             step.finish_reason);
    last["kvwire"] = stats;
    a.resp->Event(Dump(last));
    if (a.req.include_usage) {
      a.resp->Event(Dump(UsageChunkJson(endpoint, a.id, config_.name, usage)));
    }
    a.resp->EndEvents(true);
  } else {
    json out = ResponseJson(endpoint, /*chunk=*/false, false, a.id, config_.name, a.output.text(),
                            a.output.emitted(), step.finish_reason, a.output.logprobs());
    out["usage"] = usage;
    out["kvwire"] = stats;
    a.resp->Respond(200, Dump(out));
  }
  a.resp.reset();
  Finish(a);
}

// One step of an active request; true when it did work.
bool ModelServer::Impl::Advance(Active& a) {
  const absl::Time now = absl::Now();
  if (a.id.empty()) return false;  // finished earlier in this iteration
  if (a.aborting) {
    if (a.load_done || a.load_failed) Finish(a);
    return false;
  }
  if (a.resp && a.resp->closed()) {
    Cancel(a, "the client went away");
    return true;
  }
  if (a.loading) {
    if (a.load_failed) {
      load_wait_us_ += static_cast<uint64_t>(Ms(a.load_end - a.load_start) * 1000);
      Fail(a.resp, 502, absl::StrCat("KV load from prefill ", a.peer, " failed: ", a.load_error));
      a.resp.reset();
      Finish(a);
      return true;
    }
    if (now > a.deadline) {
      Cancel(a, a.resp ? "KV load did not finish before the deadline"
                       : "prepared request was never claimed");
      return true;
    }
    if (!a.load_done || !a.resp) return false;
    a.loading = false;
    Loaded(a);
    return true;
  }
  if (now > a.deadline) {
    Fail(a.resp, 504, "generation did not finish before the deadline");
    a.resp.reset();
    Finish(a);
    return true;
  }
  Step(a);
  return true;
}

// Ends a request early. Loads in flight are aborted first: their blocks go back when the
// connector reports the load (Advance frees them then).
void ModelServer::Impl::Cancel(Active& a, const std::string& why) {
  KVW_LOG(kInfo, kLog) << "request cancelled" << Kv("request", a.id) << Kv("why", why);
  if (a.load_error.empty()) a.load_error = why;
  if (a.resp && !a.resp->answered()) Fail(a.resp, 499, why);
  a.resp.reset();
  if (a.loading && !a.load_done && !a.load_failed) {
    (void)connector_->Abort(a.id);
    a.aborting = true;
    return;
  }
  Finish(a);
}

// Gives the blocks back and forgets the request (the loop erases it).
void ModelServer::Impl::Finish(Active& a) {
  if (a.remote) (void)connector_->RequestFinished(a.id, a.blocks, a.prompt.size(), "");
  cache_->Free(a.blocks);
  a.blocks.clear();
  if (!a.transfer_id.empty()) {
    auto p = prepared_.find(a.transfer_id);
    if (p != prepared_.end() && p->second == a.id) prepared_.erase(p);
  }
  a.id.clear();
}

}  // namespace dsv4::serve
