#include "examples/dsv4/serve/model_server.h"

#include <atomic>
#include <deque>
#include <map>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/kv_cache.h"
#include "examples/dsv4/model/model.h"
#include "examples/dsv4/model/tokenizer.h"
#include "examples/dsv4/serve/admission.h"
#include "examples/dsv4/serve/attest.h"
#include "examples/dsv4/serve/choices.h"
#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/generation_output.h"
#include "examples/dsv4/serve/handoff_release.h"
#include "examples/dsv4/serve/http_server.h"
#include "examples/dsv4/serve/request_check.h"
#include "examples/dsv4/serve/sampler.h"
#include "examples/dsv4/serve/transfer_report.h"
#include "kvwire/connector.h"
#include "src/util/json_fields.h"
#include "src/util/log.h"
#include "src/util/mutex.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;

namespace {

constexpr char kLog[] = "dsv4-serve";

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

// The tokens a request runs: its token ids as given, or BOS and the bytes of its text.
std::vector<int32_t> PromptTokens(const CompletionRequest& req) {
  return req.prompt_ids ? *req.prompt_ids : Encode(req.prompt);
}

// PromptTokenCount (request_check.h) counts PromptTokens without encoding: the one count that
// the request checks and KV admission use, so that a token-id prompt (whose `prompt` text is
// empty) is counted as what it is, not as one BOS.

// Tokens of an n-token prompt whose KV moves from prefill to decode: all but the last, which
// decode runs again for the logits of its first token (as vLLM's scheduler does), so that no
// sampled token has to travel with the KV. Rerunning the last token rewrites its own slots
// with the same values and recomputes a compression window it completes from the ring slots
// that moved; a one-token prompt moves whole.
uint64_t KvTokens(uint64_t n) { return n > 1 ? n - 1 : n; }

std::string DecodeTokens(std::span<const int32_t> tokens) { return Decode(tokens); }

struct Job {
  enum class Kind { kCompletion, kPrepare, kAbort, kRelease } kind = Kind::kCompletion;
  CompletionRequest req;
  std::string transfer_id;                     // kAbort
  std::string release_params, release_reason;  // kRelease (handoff_release.h)
  std::shared_ptr<Responder> resp;
  absl::Time arrived;
};

// A request that holds blocks on this server across worker iterations: a decode (loading,
// then generating) or a local generation.
struct Active {
  std::string id;
  bool remote = false;  // KV comes from a prefill server
  bool loading = false;
  bool load_done = false, load_failed = false;
  std::string load_error;
  bool aborting = false;  // blocks go back once the connector has reported the load
  CompletionRequest req;
  std::shared_ptr<Responder> resp;  // null: prepared (write mode), not yet claimed
  std::vector<int32_t> prompt;
  kvwire::BlockTable blocks;
  std::vector<int32_t> out;
  std::string transfer_id, peer;
  std::optional<Sampler> sampler;  // set when the request's answer goes to a client
  GenerationOutput output;         // what the client sees of `out`
  absl::Time arrived, claimed, load_start, load_end, decode_start, deadline;
  double prefill_ms = 0;
  json transfer;  // per-request transfer stats once loaded
  bool corrupted = false;
};

}  // namespace

class ModelServer::Impl {
 public:
  explicit Impl(ModelServerOptions options) : options_(std::move(options)) {}

  absl::Status Init() {
    const std::string& role = options_.role;
    if (role != "prefill" && role != "decode" && role != "both") {
      return absl::InvalidArgumentError(
          absl::StrCat("--role must be prefill, decode or both, not '", role, "'"));
    }
    absl::StatusOr<Config> config = Config::FromFile(options_.config_path);
    if (!config.ok()) return config.status();
    config_ = *config;
    limits_ = {.role = role,
               .max_seq_len = config_.max_seq_len,
               .vocab_size = config_.vocab_size,
               .max_logprobs = options_.max_logprobs};
    absl::StatusOr<std::unique_ptr<Model>> model =
        Model::Load(config_, options_.weights_path, options_.threads);
    if (!model.ok()) return model.status();
    model_ = std::move(*model);
    uint64_t blocks = options_.num_blocks;
    if (blocks == 0) {
      blocks = (config_.max_seq_len / 64 + 2) * std::min<uint64_t>(options_.max_requests, 4);
    }
    uint64_t seed = options_.allocation_seed;
    if (seed == 0) seed = role == "prefill" ? 11 : role == "decode" ? 22 : 33;
    absl::StatusOr<std::unique_ptr<KvCache>> cache =
        KvCache::Create(config_, blocks, options_.max_requests, seed);
    if (!cache.ok()) return cache.status();
    cache_ = std::move(*cache);
    const CacheFootprint fp = Footprint(cache_->layout());
    capacity_ = absl::StrFormat(
        "KV cache %.1f MiB: %d blocks per paged group x %.1f KiB (all groups and layers), %d "
        "state slots x %.1f KiB; admission queue %d, wait %s",
        fp.total_bytes / 1048576.0, fp.blocks, fp.block_bytes / 1024.0, fp.slots,
        fp.slot_bytes / 1024.0, options_.max_queue, absl::FormatDuration(options_.max_queue_wait));
    AdmissionOptions ao;
    ao.max_queue = options_.max_queue;
    ao.max_wait = options_.max_queue_wait;
    admission_ = std::make_unique<AdmissionQueue<Job>>(ao, Capacity(cache_->layout()));

    kvwire::ConnectorOptions co;
    co.role = role;
    absl::StatusOr<kvwire::KvMode> mode = kvwire::ParseKvMode(options_.mode);
    if (!mode.ok()) return mode.status();
    co.mode = *mode;
    co.engine = kvwire::EngineOptions::FromEnvironment({});
    if (options_.shared_secret) co.engine.shared_secret = *options_.shared_secret;
    attest_secret_ = co.engine.shared_secret;
    co.engine.name =
        options_.name.empty() ? absl::StrCat("dsv4-", role, "-", getpid()) : options_.name;
    co.engine.listen_address = absl::StrCat(options_.kv_host, ":", options_.kv_port);
    absl::StatusOr<kvwire::TransportKind> transport =
        kvwire::ParseTransportKind(options_.transport);
    if (!transport.ok()) return transport.status();
    co.engine.transport = *transport;
    co.engine.peer_lease = options_.peer_lease;
    co.engine.heartbeat_interval = std::min(absl::Milliseconds(500), options_.peer_lease / 5);
    co.request_timeout = options_.request_timeout;
    co.etcd_endpoints = options_.etcd;
    co.cluster = options_.cluster;
    co.etcd_lease_seconds = options_.etcd_lease_s;
    co.etcd_user = options_.etcd_user;
    co.etcd_password = options_.etcd_password;
    co.etcd_ca_file = options_.etcd_ca_file;
    co.etcd_cert_file = options_.etcd_cert_file;
    co.etcd_key_file = options_.etcd_key_file;
    absl::StatusOr<std::unique_ptr<kvwire::Connector>> connector = kvwire::Connector::Create(co);
    if (!connector.ok()) return connector.status();
    connector_ = std::move(*connector);
    if (absl::Status s = connector_->RegisterKvCaches(cache_->layout(), cache_->memory());
        !s.ok()) {
      return s;
    }
    // Before the worker and the HTTP threads start: they read it without a lock.
    for (const kvwire::CacheGroup& g : cache_->layout().groups) total_blocks_ += g.num_blocks;
    worker_ = std::thread([this] { Loop(); });
    HttpServerOptions ho;
    ho.host = options_.host;
    ho.port = options_.port;
    ho.max_connections_per_source = options_.max_connections_per_source;
    absl::StatusOr<std::unique_ptr<HttpServer>> http = HttpServer::Start(
        ho, [this](const HttpRequest& r, std::shared_ptr<Responder> resp) { Handle(r, resp); });
    if (!http.ok()) return http.status();
    http_port_.store((*http)->port());
    http_ = std::move(*http);
    // Serving now: visible to routers from here on (and gone first at shutdown).
    if (!options_.etcd.empty()) {
      if (absl::Status s = connector_->Announce(absl::StrCat(options_.host, ":", http_->port()));
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  ~Impl() {
    {
      kvwire::MutexLock lock(&mu_);
      stop_ = true;
      cv_.SignalAll();
    }
    if (worker_.joinable()) worker_.join();
    {
      kvwire::MutexLock lock(&mu_);
      queue_.clear();
    }
    // Responders are gone (the choices' requests to this server answered): the HTTP server
    // may go; then the connector (its transfers touch the cache), then the cache.
    choices_.reset();
    http_.reset();
    connector_.reset();
    cache_.reset();
  }

  int port() const { return http_->port(); }
  std::string kv_address() const { return connector_->engine().address(); }
  const std::string& capacity() const { return capacity_; }

 private:
  // --- HTTP thread --------------------------------------------------------------------------

  void Handle(const HttpRequest& r, std::shared_ptr<Responder> resp) {
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
  void StartChoices(const std::string& path, const HttpRequest& r, int n, bool stream,
                    const std::shared_ptr<Responder>& resp) {
    absl::StatusOr<json> body = kvwire::ParseJsonObject(r.body, "request body", kHttpJsonLimits);
    if (!body.ok()) return resp->Error(400, std::string(body.status().message()));
    const std::string self = absl::StrCat(options_.host, ":", http_port_.load());
    const absl::Time deadline =
        absl::Now() + options_.request_timeout + options_.max_queue_wait + absl::Seconds(10);
    if (!choices_->Start([self, path, body = *std::move(body), n, stream, resp, deadline] {
          RunChoices(self, path, body, n, stream, *resp, deadline,
                     [resp] { return resp->closed(); });
        })) {
      resp->Error(503, "cannot start a thread for the choices");
    }
  }

  // handoff_release.h: the worker tells the prefill that holds `params` to free its blocks.
  void QueueRelease(std::optional<std::string> params, absl::string_view why) {
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

  // Worker: a refused request's hand-off goes back to its prefill now (handoff_release.h).
  void ReleaseHandOff(const CompletionRequest& req, absl::string_view why) {
    std::optional<std::string> params = UnreadHandOff(req.kv_transfer_params);
    if (params && options_.role != "prefill") ReleaseHandOff(*params, why);
  }
  void ReleaseHandOff(const std::string& params, absl::string_view why) {
    const std::string id = NewId();
    if (absl::Status s = connector_->ReleaseUnread(id, params, std::string(why.substr(0, 200)));
        !s.ok()) {
      KVW_LOG(kWarning, kLog) << "cannot release a refused request's hand-off" << Kv("request", id)
                              << Kv("error", s.message());
    }
  }

  // attest.h: proves to a router that this server, as its etcd record describes it, holds
  // the deployment's shared secret.
  void Attest(const std::string& target, Responder& resp) const {
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
  absl::StatusOr<CompletionRequest> ParseRequest(const std::string& path,
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

  std::string Metrics() const {
    std::string m = connector_->StatsPrometheus();
    const std::string e = connector_->engine_id();
    auto line = [&](const char* name, const char* type, const std::string& labels, double v) {
      absl::StrAppend(&m, "# TYPE ", name, " ", type, "\n", name, "{engine=\"", e, "\"", labels,
                      "} ", v, "\n");
    };
    line("kvwire_dsv4_requests_ok_total", "counter", "", requests_ok_.load());
    line("kvwire_dsv4_requests_error_total", "counter", "", requests_error_.load());
    line("kvwire_dsv4_prompt_tokens_total", "counter", "", prompt_tokens_.load());
    line("kvwire_dsv4_generated_tokens_total", "counter", "", generated_tokens_.load());
    line("kvwire_dsv4_prefill_seconds_total", "counter", "", prefill_us_.load() / 1e6);
    line("kvwire_dsv4_decode_seconds_total", "counter", "", decode_us_.load() / 1e6);
    line("kvwire_dsv4_kv_load_wait_seconds_total", "counter", "", load_wait_us_.load() / 1e6);
    line("kvwire_dsv4_used_blocks", "gauge", "", static_cast<double>(cache_->UsedBlocks()));
    line("kvwire_dsv4_active_requests", "gauge", "", active_count_.load());
    line("kvwire_dsv4_held_blocks", "gauge", "", static_cast<double>(held_blocks_.load()));
    absl::StrAppend(&m, admission_->stats().Prometheus(e),
                    connector_->engine().Stats().ToPrometheus(e));
    return m;
  }

  // --- worker thread ------------------------------------------------------------------------

  void Loop() {
    while (true) {
      std::deque<Job> jobs;
      {
        kvwire::MutexLock lock(&mu_);
        if (stop_) break;
        jobs.swap(queue_);
      }
      PollConnector();
      for (Job& j : jobs) Enqueue(j);
      PumpAdmission();
      bool progressed = !jobs.empty();
      std::vector<std::string> ids;
      for (const auto& [id, a] : active_) ids.push_back(id);
      for (const std::string& id : ids) {
        if (Advance(active_.at(id))) progressed = true;
      }
      for (auto it = active_.begin(); it != active_.end();) {
        it = it->second.id.empty() ? active_.erase(it) : std::next(it);
      }
      active_count_.store(static_cast<int>(active_.size()));
      held_count_.store(static_cast<int>(held_.size()));
      held_blocks_.store(HeldBlocks());
      if (!progressed) {
        kvwire::MutexLock lock(&mu_);
        if (queue_.empty() && !stop_) cv_.WaitUntil(&mu_, absl::Now() + absl::Milliseconds(1));
      }
    }
    Shutdown();
  }

  // Aborts what is in flight and waits (bounded) until the connector lets go of the blocks.
  void Shutdown() {
    admission_->Drain([this](Job& j, Rejection, const std::string& why) {
      ReleaseHandOff(j.req, why);
      Overloaded(j.resp, why);
    });
    for (auto& [id, a] : active_) {
      if (a.resp && !a.resp->answered()) a.resp->Error(503, "server is shutting down");
      if (a.resp && a.resp->streaming()) a.resp->EndEvents(false);
      a.resp.reset();
      if (a.loading && !a.load_done && !a.load_failed) (void)connector_->Abort(a.id);
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (absl::Now() < deadline && connector_->LiveRequests() > 0) {
      PollConnector();
      absl::SleepFor(absl::Milliseconds(5));
    }
    active_.clear();
    held_.clear();
    held_blocks_.store(0);
  }

  void PollConnector() {
    kvwire::FinishedRequests f = connector_->GetFinished();
    for (const std::string& id : f.finished_sending) {
      auto it = held_.find(id);
      if (it == held_.end()) continue;
      cache_->Free(it->second);
      held_.erase(it);
    }
    for (const std::string& id : f.finished_recving) {
      auto it = active_.find(id);
      if (it == active_.end()) continue;
      it->second.load_done = true;
      it->second.load_end = absl::Now();
    }
    for (const kvwire::FailedLoad& fl : f.failed_loads) {
      auto it = active_.find(fl.request_id);
      if (it == active_.end()) continue;
      it->second.load_failed = true;
      it->second.load_error = fl.reason;
      it->second.load_end = absl::Now();
    }
  }

  std::string NewId() { return absl::StrCat("cmpl-", getpid(), "-", ++seq_); }

  // Requests are parsed and type-checked on the HTTP thread; this is the backstop that keeps
  // a bug in their handling from ending the process with every other request in it.
  void AdmitGuarded(Job& job) {
    try {
      Admit(job);
    } catch (const std::exception& e) {
      KVW_LOG(kError, kLog) << "request handling threw" << Kv("error", e.what());
      Fail(job.resp, 500, absl::StrCat("internal error: ", e.what()));
    }
  }

  // --- admission (admission.h) -------------------------------------------------------------

  // Jobs that take blocks wait for them in the admission queue; the others run now.
  void Enqueue(Job& job) {
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
  std::optional<uint64_t> TokensToHold(const Job& job) const {
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

  void PumpAdmission() {
    admission_->Pump(
        absl::Now(), [this] { return Available(); },
        [](const Job& j) { return j.resp && j.resp->closed(); },
        [this](Job& j) { AdmitGuarded(j); },
        [this](Job& j, Rejection why, const std::string& message) {
          ReleaseHandOff(j.req, message);
          if (why == Rejection::kClientGone) return Fail(j.resp, 499, message);
          Overloaded(j.resp, message);
        });
  }

  // Free blocks less what the live requests may still grow into (their reservations).
  BlockCounts Available() const {
    BlockCounts available = cache_->FreeBlocks();
    for (const auto& [id, a] : active_) {
      if (a.id.empty()) continue;
      SubtractGrowth(
          BlocksNeeded(cache_->layout(), a.prompt.size() + static_cast<uint64_t>(a.req.max_tokens)),
          a.blocks, &available);
    }
    return available;
  }

  uint64_t HeldBlocks() const {
    uint64_t n = 0;
    for (const auto& [id, table] : held_) {
      for (const auto& [group, ids] : table) {
        for (int64_t b : ids) n += b >= 0 ? 1 : 0;
      }
    }
    return n;
  }

  // 503 with Retry-After: the client should come back later.
  void Overloaded(const std::shared_ptr<Responder>& resp, const std::string& message) {
    ++requests_error_;
    KVW_LOG(kInfo, kLog) << "request refused" << Kv("status", 503) << Kv("error", message);
    if (resp) resp->ErrorRetryAfter(503, message, absl::Seconds(1));
  }

  // /health: the admission queue, and the engine's and connector's balances.
  void AddLoadHealth(json& j) const {
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

  void Admit(Job& job) {
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

  // --- prefill ------------------------------------------------------------------------------

  void RunPrefill(Job& job) {
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
  void Release(const std::string& id, kvwire::BlockTable& blocks, uint64_t n,
               const std::string& params, bool aborted = true) {
    absl::StatusOr<kvwire::RequestFinishedResult> rf =
        connector_->RequestFinished(id, blocks, n, params, aborted);
    if (rf.ok() && rf->delay_free) {
      held_[id] = std::move(blocks);
    } else {
      cache_->Free(blocks);
    }
  }

  void Fail(const std::shared_ptr<Responder>& resp, int status, const std::string& message) {
    ++requests_error_;
    KVW_LOG(kInfo, kLog) << "request failed" << Kv("status", status) << Kv("error", message);
    if (!resp) return;
    if (resp->streaming()) {
      resp->Event(ErrorJson(status, message));
      resp->EndEvents(false);
    } else {
      resp->Error(status, message);
    }
  }

  // --- decode -------------------------------------------------------------------------------

  // Allocates and starts the load of a remote-prefill request; false (answered) on error.
  bool StartLoad(Active& a, const std::shared_ptr<Responder>& resp) {
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

  void Prepare(Job& job) {
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

  void StartDecode(Job& job) {
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
    Active a;
    a.id = NewId();
    a.req = job.req;
    a.resp = job.resp;
    a.prompt = PromptTokens(job.req);
    InitSampling(a);
    a.arrived = a.claimed = job.arrived;
    a.deadline = absl::Now() + options_.request_timeout;
    if (!StartLoad(a, a.resp)) return;
    const std::string id = a.id;
    active_.emplace(id, std::move(a));
  }

  // Ends a request early. Loads in flight are aborted first: their blocks go back when the
  // connector reports the load (Advance frees them then).
  void Cancel(Active& a, const std::string& why) {
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
  void Finish(Active& a) {
    if (a.remote) (void)connector_->RequestFinished(a.id, a.blocks, a.prompt.size(), "");
    cache_->Free(a.blocks);
    a.blocks.clear();
    if (!a.transfer_id.empty()) {
      auto p = prepared_.find(a.transfer_id);
      if (p != prepared_.end() && p->second == a.id) prepared_.erase(p);
    }
    a.id.clear();
  }

  // One step of an active request; true when it did work.
  bool Advance(Active& a) {
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

  // Decode: the KV is in place; the first token (prefill's) goes out.
  void Loaded(Active& a) {
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

  // --- local generation ---------------------------------------------------------------------

  void StartLocal(Job& job) {
    Active a;
    a.id = NewId();
    a.req = job.req;
    a.resp = job.resp;
    a.prompt = PromptTokens(job.req);
    InitSampling(a);
    a.arrived = a.claimed = job.arrived;
    a.deadline = absl::Now() + options_.request_timeout;
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

  // --- generation ---------------------------------------------------------------------------

  void Step(Active& a) {
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
  static void InitSampling(Active& a) {
    const SamplingParams& p = a.req.sampling;
    a.sampler.emplace(p, p.seed ? *p.seed : RandomSeed(), a.prompt, kEosToken);
    a.output = GenerationOutput(a.req, kEosToken, DecodeTokens,
                                a.req.prompt_ids ? Decode(*a.req.prompt_ids) : a.req.prompt);
  }

  // Appends a token, streams what the output releases, and completes the request at a stop
  // string, EOS (unless ignore_eos) or max_tokens.
  void Emit(Active& a, const Sampled& sampled) {
    a.out.push_back(sampled.token);
    ++generated_tokens_;
    GenerationOutput::Step step = a.output.Feed(sampled);
    const Endpoint endpoint = a.req.endpoint;
    if (a.req.stream && (!step.tokens.empty() || !step.text.empty())) {
      const bool first = !a.resp->streaming();
      if (first) a.resp->StartEvents();
      a.resp->Event(Dump(ResponseJson(endpoint, /*chunk=*/true, first, a.id, config_.name,
                                      step.text, step.tokens, nullptr, step.logprobs)));
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

  void Delay() {
    if (options_.inject_delay_ms > 0) absl::SleepFor(absl::Milliseconds(options_.inject_delay_ms));
  }

  const ModelServerOptions options_;
  std::string capacity_;
  Config config_;
  ServerLimits limits_;  // set in Init
  std::unique_ptr<Model> model_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<kvwire::Connector> connector_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<int> http_port_{0};  // for handlers, which run before http_ is assigned
  std::unique_ptr<ChoicesRunner> choices_ = std::make_unique<ChoicesRunner>();
  std::thread worker_;
  uint64_t total_blocks_ = 0;  // over the paged groups (set in Init)
  std::string attest_secret_;  // the engine's shared secret (set in Init; empty: none)

  kvwire::Mutex mu_;
  kvwire::CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);

  // Worker thread only.
  std::map<std::string, Active> active_;
  std::map<std::string, std::string> prepared_;     // transfer id -> request id
  std::map<std::string, kvwire::BlockTable> held_;  // prefill: until finished_sending
  uint64_t seq_ = 0;

  std::unique_ptr<AdmissionQueue<Job>> admission_;  // queue: worker only; stats: any thread
  std::atomic<int> active_count_{0}, held_count_{0}, prefilling_{0};
  std::atomic<uint64_t> held_blocks_{0};
  std::atomic<uint64_t> requests_ok_{0}, requests_error_{0}, prompt_tokens_{0},
      generated_tokens_{0}, prefill_us_{0}, decode_us_{0}, load_wait_us_{0};
};

absl::StatusOr<std::unique_ptr<ModelServer>> ModelServer::Start(const ModelServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<ModelServer>(new ModelServer(std::move(impl)));
}

ModelServer::ModelServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ModelServer::~ModelServer() = default;
int ModelServer::port() const { return impl_->port(); }
std::string ModelServer::kv_address() const { return impl_->kv_address(); }
std::string ModelServer::capacity() const { return impl_->capacity(); }

}  // namespace dsv4::serve
