// The model server's admission (worker thread): jobs that take KV blocks wait for them in the
// admission queue (admission.h); refused ones are answered 503 with Retry-After and their
// hand-offs released; admitted ones go to their role (prefill, decode, local generation).
#include <algorithm>
#include <exception>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/handoff_release.h"
#include "examples/dsv4/serve/model_server_impl.h"
#include "src/util/log.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;

// Worker: a refused request's hand-off goes back to its prefill now (handoff_release.h).
void ModelServer::Impl::ReleaseHandOff(const CompletionRequest& req, absl::string_view why) {
  std::optional<std::string> params = UnreadHandOff(req.kv_transfer_params);
  if (params && options_.role != "prefill") ReleaseHandOff(*params, why);
}

void ModelServer::Impl::ReleaseHandOff(const std::string& params, absl::string_view why) {
  const std::string id = NewId();
  if (absl::Status s = connector_->ReleaseUnread(id, params, std::string(why.substr(0, 200)));
      !s.ok()) {
    KVW_LOG(kWarning, kLog) << "cannot release a refused request's hand-off" << Kv("request", id)
                            << Kv("error", s.message());
  }
}

// Requests are parsed and type-checked on the HTTP thread; this is the backstop that keeps
// a bug in their handling from ending the process with every other request in it.
void ModelServer::Impl::AdmitGuarded(Job& job) {
  try {
    Admit(job);
  } catch (const std::exception& e) {
    KVW_LOG(kError, kLog) << "request handling threw" << Kv("error", e.what());
    Fail(job.resp, 500, absl::StrCat("internal error: ", e.what()));
  }
}

// Jobs that take blocks wait for them in the admission queue; the others run now.
void ModelServer::Impl::Enqueue(Job& job) {
  const std::optional<uint64_t> tokens = TokensToHold(job);
  if (!tokens) return AdmitGuarded(job);
  absl::Status s = admission_->Offer(job, BlocksNeeded(cache_->layout(), *tokens), job.arrived);
  if (s.ok()) return;
  ReleaseHandOff(job.req, s.message());
  if (absl::IsResourceExhausted(s)) return Overloaded(job.resp, std::string(s.message()));
  Fail(job.resp, 400, std::string(s.message()));
}

// The most tokens whose KV a job will hold: a prefill its prompt; a decode or a local
// generation the prompt and every token it may generate. None for jobs that take no blocks
// (aborts, and a write-mode decode claiming the blocks it prepared).
std::optional<uint64_t> ModelServer::Impl::TokensToHold(const Job& job) const {
  if (job.kind == Job::Kind::kAbort || job.kind == Job::Kind::kRelease) return std::nullopt;
  const uint64_t n = PromptTokenCount(job.req);
  if (job.kind == Job::Kind::kCompletion) {
    const KvTransferFields& kv = job.req.kv;
    if (kv.do_remote_decode) return n;
    if (kv.do_remote_prefill && kv.mode == "write" && prepared_.count(kv.transfer_id) != 0) {
      return std::nullopt;
    }
  }
  return n + static_cast<uint64_t>(std::max(0, job.req.max_tokens));
}

void ModelServer::Impl::PumpAdmission() {
  admission_->Pump(
      absl::Now(), [this] { return Available(); },
      [](const Job& j) { return j.resp && j.resp->closed(); }, [this](Job& j) { AdmitGuarded(j); },
      [this](Job& j, Rejection why, const std::string& message) {
        ReleaseHandOff(j.req, message);
        if (why == Rejection::kClientGone) return Fail(j.resp, 499, message);
        Overloaded(j.resp, message);
      });
}

// Free blocks less what the live requests may still grow into (their reservations).
BlockCounts ModelServer::Impl::Available() const {
  BlockCounts available = cache_->FreeBlocks();
  for (const auto& [id, a] : active_) {
    if (a.id.empty()) continue;
    SubtractGrowth(
        BlocksNeeded(cache_->layout(), a.prompt.size() + static_cast<uint64_t>(a.req.max_tokens)),
        a.blocks, &available);
  }
  return available;
}

uint64_t ModelServer::Impl::HeldBlocks() const {
  uint64_t n = 0;
  for (const auto& [id, table] : held_) {
    for (const auto& [group, ids] : table) {
      for (int64_t b : ids) n += b >= 0 ? 1 : 0;
    }
  }
  return n;
}

// 503 with Retry-After: the client should come back later.
void ModelServer::Impl::Overloaded(const std::shared_ptr<Responder>& resp,
                                   const std::string& message) {
  ++requests_error_;
  KVW_LOG(kInfo, kLog) << "request refused" << Kv("status", 503) << Kv("error", message);
  if (resp) resp->ErrorRetryAfter(503, message, absl::Seconds(1));
}

void ModelServer::Impl::Admit(Job& job) {
  switch (job.kind) {
    case Job::Kind::kAbort: {
      auto p = prepared_.find(job.transfer_id);
      if (p == prepared_.end()) {
        job.resp->Error(404,
                        absl::StrCat("no prepared request with transfer_id ", job.transfer_id));
        return;
      }
      Active& a = active_.at(p->second);
      prepared_.erase(p);
      Cancel(a, "aborted by the router");
      job.resp->Respond(200, json{{"aborted", true}}.dump());
      return;
    }
    case Job::Kind::kPrepare:
      Prepare(job);
      return;
    case Job::Kind::kRelease:
      return ReleaseHandOff(job.release_params, job.release_reason);
    case Job::Kind::kCompletion:
      break;
  }
  if (job.req.kv.do_remote_decode) {
    RunPrefill(job);
  } else if (job.req.kv.do_remote_prefill) {
    StartDecode(job);
  } else {
    StartLocal(job);
  }
}

}  // namespace dsv4::serve
