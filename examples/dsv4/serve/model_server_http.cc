// The model server's HTTP surface (HTTP thread): routes, request parsing and checks, the jobs
// it queues for the worker, /health, /metrics and the attestation answer.
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/attest.h"
#include "examples/dsv4/serve/handoff_release.h"
#include "examples/dsv4/serve/model_server_impl.h"
#include "src/util/json_fields.h"
#include "src/util/log.h"
#include "src/util/prometheus_text.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;

void ModelServer::Impl::Handle(const HttpRequest& r, std::shared_ptr<Responder> resp) {
  const std::string path = r.target.substr(0, r.target.find('?'));
  if (r.method == "GET" && path == "/health") {
    json j = {{"status", "ok"},
              {"role", options_.role},
              {"model", config_.name},
              {"engine_id", connector_->engine_id()},
              {"kv_address", connector_->engine().address()},
              {"mode", options_.mode},
              {"transport", options_.transport},
              {"used_blocks", cache_->UsedBlocks()},
              {"total_blocks", total_blocks_},
              {"announced", connector_->Announced()},
              {"live_connector_requests", connector_->LiveRequests()},
              {"active_requests", active_count_.load()},
              {"held_requests", held_count_.load()},
              {"held_blocks", held_blocks_.load()},
              {"prefilling", prefilling_.load()}};
    AddLoadHealth(j);
    resp->Respond(200, j.dump());
    return;
  }
  if (r.method == "GET" && path == "/metrics") {
    resp->Respond(200, Metrics(), "text/plain; version=0.0.4");
    return;
  }
  if (r.method == "GET" && path == kAttestPath) {
    Attest(r.target, *resp);
    return;
  }
  if (r.method == "GET" && path == "/v1/models") {
    resp->Respond(200, ModelsJson(config_.name, config_.max_seq_len).dump());
    return;
  }
  Job job;
  job.arrived = absl::Now();
  if (path == "/v1/completions" || path == "/v1/chat/completions" || path == "/v1/kv/prepare") {
    if (r.method != "POST") {
      resp->Error(405, absl::StrCat("use POST for ", path));
      return;
    }
    absl::StatusOr<CompletionRequest> req = ParseRequest(path, r.body);
    if (!req.ok()) {
      resp->Error(400, std::string(req.status().message()));
      return QueueRelease(UnreadHandOffInBody(r.body), req.status().message());
    }
    if (!req->model.empty() && req->model != config_.name) {
      const std::string m = absl::StrCat(
          "the model '", req->model, "' does not exist (this server runs '", config_.name, "')");
      resp->Error(404, m);
      return QueueRelease(UnreadHandOff(req->kv_transfer_params), m);
    }
    if (absl::Status s = CheckRequest(*req, path == "/v1/kv/prepare", limits_); !s.ok()) {
      resp->Error(400, std::string(s.message()));
      return QueueRelease(UnreadHandOff(req->kv_transfer_params), s.message());
    }
    // A prefill computes the prompt once, whatever n is.
    if (req->sampling.n > 1 && !req->kv.do_remote_decode) {
      return StartChoices(path, r, req->sampling.n, req->stream, resp);
    }
    job.kind = path == "/v1/kv/prepare" ? Job::Kind::kPrepare : Job::Kind::kCompletion;
    job.req = std::move(*req);
  } else if (path == "/v1/kv/abort" && r.method == "POST") {
    absl::StatusOr<json> j = kvwire::ParseJsonObject(r.body, "request body", kHttpJsonLimits);
    absl::Status s = j.status();
    if (s.ok()) {
      kvwire::JsonFields f(*j, "request body");
      job.transfer_id = f.String("transfer_id", kMaxIdBytes);
      if (f.ok() && job.transfer_id.empty()) f.Fail("transfer_id", "must not be empty");
      s = f.status();
    }
    if (!s.ok()) {
      resp->Error(400, std::string(s.message()));
      return;
    }
    job.kind = Job::Kind::kAbort;
  } else {
    resp->Error(404, absl::StrCat("no route for ", r.method, " ", path));
    return;
  }
  job.resp = std::move(resp);
  kvwire::MutexLock lock(&mu_);
  if (stop_) {
    job.resp->Error(503, "server is shutting down");
    return;
  }
  queue_.push_back(std::move(job));
  cv_.SignalAll();
}

// choices.h: n one-choice requests to this server itself, answered as one.
void ModelServer::Impl::StartChoices(const std::string& path, const HttpRequest& r, int n,
                                     bool stream, const std::shared_ptr<Responder>& resp) {
  absl::StatusOr<json> body = kvwire::ParseJsonObject(r.body, "request body", kHttpJsonLimits);
  if (!body.ok()) return resp->Error(400, std::string(body.status().message()));
  const std::string self = absl::StrCat(options_.host, ":", http_port_.load());
  const absl::Time deadline =
      absl::Now() + options_.request_timeout + options_.max_queue_wait + absl::Seconds(10);
  if (!choices_->Start([self, path, body = *std::move(body), n, stream, resp, deadline] {
        RunChoices(self, path, body, n, stream, *resp, deadline, [resp] { return resp->closed(); });
      })) {
    resp->Error(503, "cannot start a thread for the choices");
  }
}

// handoff_release.h: the worker tells the prefill that holds `params` to free its blocks.
void ModelServer::Impl::QueueRelease(std::optional<std::string> params, absl::string_view why) {
  if (!params || options_.role == "prefill") return;
  Job job;
  job.kind = Job::Kind::kRelease;
  job.arrived = absl::Now();
  job.release_params = *std::move(params);
  job.release_reason = std::string(why.substr(0, 200));
  kvwire::MutexLock lock(&mu_);
  if (stop_) return;
  queue_.push_back(std::move(job));
  cv_.SignalAll();
}

// attest.h: proves to a router that this server, as its etcd record describes it, holds
// the deployment's shared secret.
void ModelServer::Impl::Attest(const std::string& target, Responder& resp) const {
  if (attest_secret_.empty()) {
    resp.Error(404, "this server has no shared secret: it cannot prove membership");
    return;
  }
  absl::StatusOr<std::string> nonce = AttestNonce(target);
  if (!nonce.ok()) {
    resp.Error(400, std::string(nonce.status().message()));
    return;
  }
  AttestClaim claim;
  claim.engine_id = connector_->engine_id();
  claim.role = options_.role;
  claim.http_address = absl::StrCat(options_.host, ":", http_->port());
  claim.kv_address = connector_->engine().address();
  json j = {{"engine_id", claim.engine_id},
            {"role", claim.role},
            {"http_address", claim.http_address},
            {"kv_address", claim.kv_address},
            {"proof", AttestProof(attest_secret_, *nonce, claim)}};
  resp.Respond(200, j.dump());
}

// A completion or chat request; prepare takes either (chat when it has messages).
absl::StatusOr<CompletionRequest> ModelServer::Impl::ParseRequest(const std::string& path,
                                                                  const std::string& body) const {
  if (path == "/v1/chat/completions") {
    return ParseCompletionRequest(body, config_.vocab_size, Endpoint::kChat);
  }
  if (path == "/v1/completions") return ParseCompletionRequest(body, config_.vocab_size);
  absl::StatusOr<json> j = kvwire::ParseJsonObject(body, "request body", kHttpJsonLimits);
  if (!j.ok()) return j.status();
  return CompletionRequestFromJson(
      *j, config_.vocab_size, j->contains("messages") ? Endpoint::kChat : Endpoint::kCompletions);
}

std::string ModelServer::Impl::Metrics() const {
  std::string m = connector_->StatsPrometheus();
  const std::string e = connector_->engine_id();
  const std::string label = kvwire::PrometheusLabelValue(e);
  // One family: its HELP and TYPE lines, then its sample.
  auto family = [&](const char* name, const char* type, const char* help, double v) {
    absl::StrAppend(&m, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name,
                    "{engine=\"", label, "\"} ", v, "\n");
  };
  family("kvwire_dsv4_requests_ok_total", "counter",
         "Requests answered successfully (prefill hand-offs, decodes, local generations).",
         requests_ok_.load());
  family("kvwire_dsv4_requests_error_total", "counter",
         "Requests answered with an error, refused or cancelled.", requests_error_.load());
  family("kvwire_dsv4_prompt_tokens_total", "counter",
         "Prompt tokens computed here (prefill and local generation; a decode's loaded prompt "
         "is not counted).",
         prompt_tokens_.load());
  family("kvwire_dsv4_generated_tokens_total", "counter",
         "Tokens sampled here (a prefill's first token included).", generated_tokens_.load());
  family("kvwire_dsv4_prefill_seconds_total", "counter",
         "Seconds spent computing prompts (prefill and local generation).",
         prefill_us_.load() / 1e6);
  family("kvwire_dsv4_decode_seconds_total", "counter",
         "Seconds from a request's first decode step to its answer, over answered requests.",
         decode_us_.load() / 1e6);
  family("kvwire_dsv4_kv_load_wait_seconds_total", "counter",
         "Seconds decode requests waited for their KV to arrive from prefill.",
         load_wait_us_.load() / 1e6);
  family("kvwire_dsv4_used_blocks", "gauge", "KV cache blocks allocated now (all paged groups).",
         static_cast<double>(cache_->UsedBlocks()));
  family("kvwire_dsv4_active_requests", "gauge",
         "Requests holding KV blocks on the worker now (decodes, local generations, prepared "
         "write-mode loads).",
         active_count_.load());
  family("kvwire_dsv4_held_blocks", "gauge",
         "KV cache blocks a prefill holds for its readers (read-mode hand-offs not yet released).",
         static_cast<double>(held_blocks_.load()));
  absl::StrAppend(&m, admission_->stats().Prometheus(e),
                  connector_->engine().Stats().ToPrometheus(e));
  return m;
}

// /health: the admission queue, and the engine's and connector's balances.
void ModelServer::Impl::AddLoadHealth(json& j) const {
  j["admission"] = admission_->stats().Json(options_.max_queue);
  const kvwire::EngineStats es = connector_->engine().Stats();
  j["engine_transfers"] = {{"started", es.transfers_started},
                           {"succeeded", es.transfers_succeeded},
                           {"failed", es.transfers_failed}};
  json cs = json::parse(connector_->StatsJson(), nullptr, false);
  json c = json::object();
  if (cs.is_object()) {
    for (const char* k : {"started", "completed", "failed", "withdrawn", "released",
                          "lease_expired", "live_requests"}) {
      if (cs.contains(k)) c[k] = cs[k];
    }
  }
  j["connector"] = c;
}

}  // namespace dsv4::serve
