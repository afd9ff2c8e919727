// `kvwire-dsv4 serve`: the server's lifecycle (start-up, KV cache and connector, shutdown),
// the worker thread's loop, and the public ModelServer facade. The other parts of
// ModelServer::Impl (model_server_impl.h) live in files of one job each.
#include "examples/dsv4/serve/model_server.h"

#include <algorithm>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/model_server_impl.h"
#include "src/util/log.h"

namespace dsv4::serve {

using kvwire::Kv;
using nlohmann::json;

absl::Status ModelServer::Impl::Init() {
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
  absl::StatusOr<kvwire::EngineOptions> from_env = kvwire::EngineOptions::FromEnvironment({});
  if (!from_env.ok()) return from_env.status();
  co.engine = *std::move(from_env);
  if (options_.shared_secret) co.engine.shared_secret = *options_.shared_secret;
  attest_secret_ = co.engine.shared_secret;
  co.engine.name =
      options_.name.empty() ? absl::StrCat("dsv4-", role, "-", getpid()) : options_.name;
  co.engine.listen_address = absl::StrCat(options_.kv_host, ":", options_.kv_port);
  co.engine.transport = options_.transport;  // checked by Engine::Create
  co.engine.peer_lease = options_.peer_lease;
  // KVWIRE_VERIFY_CHECKSUMS=1 (FromEnvironment above) turns it on as well.
  if (options_.verify_kv) co.engine.verify_checksums = true;
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
  if (absl::Status s = connector_->RegisterKvCaches(cache_->layout(), cache_->memory()); !s.ok()) {
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

ModelServer::Impl::~Impl() {
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

void ModelServer::Impl::Loop() {
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
void ModelServer::Impl::Shutdown() {
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

void ModelServer::Impl::PollConnector() {
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

void ModelServer::Impl::Fail(const std::shared_ptr<Responder>& resp, int status,
                             const std::string& message) {
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
