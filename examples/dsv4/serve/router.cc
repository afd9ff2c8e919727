// The router: start-up and shutdown, its HTTP surface, and a thread per request (the
// proxy of one request is router_proxy.cc's).
#include "examples/dsv4/serve/router.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <random>
#include <system_error>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/choices.h"
#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/http_server.h"
#include "examples/dsv4/serve/instance_set.h"
#include "examples/dsv4/serve/router_impl.h"
#include "src/util/json_fields.h"
#include "src/util/log.h"
#include "src/util/mutex.h"

namespace dsv4::serve {

using kvwire::JsonFields;
using kvwire::Kv;
using nlohmann::json;

namespace {

// The query of a choice's request to the router itself: kChoiceQuery and the token.
constexpr char kChoiceQuery[] = "kvwire_choice=";

}  // namespace

int Router::Impl::StatusFor(const absl::Status& s) {
  if (absl::IsDeadlineExceeded(s)) return 504;
  if (absl::IsUnavailable(s)) return 503;
  return 502;
}

std::string Router::Impl::UpstreamMessage(const HttpResponse& r) {
  absl::StatusOr<json> j = kvwire::ParseJsonObject(r.body, "upstream error", kHttpJsonLimits);
  if (j.ok()) {
    JsonFields f(*j, "upstream error");
    std::string message = f.Nested("error", /*required=*/true).String("message");
    if (f.ok() && !message.empty()) return message;
  }
  return r.body.substr(0, 300);
}

std::string Router::Impl::RandomToken() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&out, absl::Hex(rd(), absl::kZeroPad8));
  return out;
}

absl::Status Router::Impl::Start() {
  if (options_.mode != "read" && options_.mode != "write") {
    return absl::InvalidArgumentError(
        absl::StrCat("router --mode must be read or write, not '", options_.mode, "'"));
  }
  // The lists, or etcd discovery; validated there.
  InstanceSetOptions io;
  io.prefill = options_.prefill;
  io.decode = options_.decode;
  io.etcd = options_.etcd;
  io.cluster = options_.cluster;
  io.etcd_access = options_.etcd_access;
  io.policy = options_.policy;
  io.secret = options_.secret;
  io.forget_after = options_.forget_instance_after;
  absl::StatusOr<std::unique_ptr<InstanceSet>> instances = InstanceSet::Start(io);
  if (!instances.ok()) return instances.status();
  instances_ = std::move(*instances);
  HttpServerOptions so;
  so.host = options_.host;
  so.port = options_.port;
  so.max_connections_per_source = options_.max_connections_per_source;
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(
      so, [this](const HttpRequest& r, std::shared_ptr<Responder> resp) { Handle(r, resp); });
  if (!server.ok()) return server.status();
  port_.store((*server)->port());
  server_ = std::move(*server);
  return absl::OkStatus();
}

Router::Impl::~Impl() {
  {
    kvwire::MutexLock lock(&mu_);
    stopping_ = true;
  }
  // Request threads end by their deadlines (streams stop at once when stopping_).
  std::list<Worker> workers;
  {
    kvwire::MutexLock lock(&mu_);
    workers.swap(workers_);
  }
  for (Worker& w : workers) w.thread.join();
  server_.reset();
}

void Router::Impl::Handle(const HttpRequest& r, std::shared_ptr<Responder> resp) {
  const std::string path = r.target.substr(0, r.target.find('?'));
  if (r.method == "GET" && path == "/health") {
    json j = {{"status", "ok"},
              {"role", "router"},
              {"mode", options_.mode},
              {"inflight", inflight_.load()}};
    j.update(instances_->Health());
    resp->Respond(200, j.dump());
    return;
  }
  if (r.method == "GET" && path == "/metrics") {
    std::string m =
        "# HELP kvwire_dsv4_router_requests_total Requests the router finished, by outcome.\n"
        "# TYPE kvwire_dsv4_router_requests_total counter\n";
    absl::StrAppend(&m, "kvwire_dsv4_router_requests_total{outcome=\"ok\"} ", ok_.load(), "\n",
                    "kvwire_dsv4_router_requests_total{outcome=\"error\"} ", errors_.load(), "\n",
                    "kvwire_dsv4_router_requests_total{outcome=\"client_gone\"} ",
                    client_gone_.load(), "\n",
                    "# HELP kvwire_dsv4_router_upstream_too_large_total Upstream answers larger "
                    "than the router's limit (--max-upstream-body-mib).\n",
                    "# TYPE kvwire_dsv4_router_upstream_too_large_total counter\n",
                    "kvwire_dsv4_router_upstream_too_large_total ", too_large_.load(), "\n",
                    "# HELP kvwire_dsv4_router_inflight Requests in flight through the router "
                    "(a request with n choices counts n).\n",
                    "# TYPE kvwire_dsv4_router_inflight gauge\n", "kvwire_dsv4_router_inflight ",
                    inflight_.load(), "\n", instances_->Metrics());
    resp->Respond(200, m, "text/plain; version=0.0.4");
    return;
  }
  // Upstream calls block: each request gets a thread.
  std::function<void()> work;
  int cost = 1;  // requests in flight it counts as (a request with n choices: n)
  if (r.method == "GET" && path == "/v1/models") {
    work = [this, resp] { Models(resp); };
  } else {
    if (path != "/v1/completions" && path != "/v1/chat/completions") {
      resp->Error(404, absl::StrCat("no route for ", r.method, " ", path));
      return;
    }
    if (r.method != "POST") {
      resp->Error(405, absl::StrCat("use POST for ", path));
      return;
    }
    const Endpoint endpoint =
        path == "/v1/chat/completions" ? Endpoint::kChat : Endpoint::kCompletions;
    // Refused here rather than after prefill has computed and holds blocks for decode.
    absl::StatusOr<json> body = kvwire::ParseJsonObject(r.body, "request body", kHttpJsonLimits);
    absl::StatusOr<CompletionRequest> req =
        body.ok() ? CompletionRequestFromJson(*body, INT32_MAX, endpoint) : body.status();
    if (!req.ok()) {
      resp->Error(400, std::string(req.status().message()));
      return;
    }
    if (req->sampling.n > 1) {
      // choices.h: one whole hand-off per choice, through this router. The n choices are
      // the request's cost against --max-inflight, reserved here; their requests to this
      // router carry the choice token and count no more.
      const int n = req->sampling.n;
      if (n > options_.max_inflight) {
        resp->Error(400, absl::StrCat("'n' (", n, ") is more than this router's requests in ",
                                      "flight (--max-inflight ", options_.max_inflight, ")"));
        return;
      }
      cost = n;
      work = [this, body = *std::move(body), n, stream = req->stream,
              target = absl::StrCat(path, "?", kChoiceQuery, choice_token_), resp] {
        RunChoices(absl::StrCat(options_.host, ":", port_.load()), target, body, n, stream, *resp,
                   absl::Now() + options_.timeout,
                   [this, resp] { return Stopping() || resp->closed(); });
      };
    } else {
      if (IsChoiceOfThisRouter(r.target)) cost = 0;  // reserved by its parent request
      work = [this, body = *std::move(body), stream = req->stream, endpoint, resp]() mutable {
        ProxyGuarded(std::move(body), stream, endpoint, resp);
      };
    }
  }
  kvwire::MutexLock lock(&mu_);
  if (stopping_) {
    resp->Error(503, "router is shutting down");
    return;
  }
  if (cost > 0 && inflight_.load() + cost > options_.max_inflight) {
    resp->ErrorRetryAfter(503,
                          absl::StrCat("too many requests in flight (", options_.max_inflight, ")"),
                          absl::Seconds(1));
    return;
  }
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  inflight_ += cost;
  auto done = std::make_shared<std::atomic<bool>>(false);
  try {
    workers_.push_back({std::thread([this, work = std::move(work), resp, done, cost]() mutable {
                          work();
                          work = nullptr;
                          resp.reset();  // the answer is queued before the thread counts as done
                          inflight_ -= cost;
                          done->store(true);
                        }),
                        done});
  } catch (const std::system_error& e) {
    inflight_ -= cost;
    resp->Error(503, absl::StrCat("cannot start a request thread: ", e.what()));
  }
}

// Requests and upstream answers are type-checked; this is the backstop that keeps a bug in
// their handling from ending the process with every other request in it.
void Router::Impl::ProxyGuarded(json body, bool stream, Endpoint endpoint,
                                const std::shared_ptr<Responder>& resp) {
  try {
    Proxy(std::move(body), stream, endpoint, resp);
  } catch (const std::exception& e) {
    KVW_LOG(kError, kLog) << "request handling threw" << Kv("error", e.what());
    if (resp->streaming()) {
      resp->Event(ErrorJson(500, absl::StrCat("internal error: ", e.what())));
      resp->EndEvents(/*done=*/false);
    } else {
      resp->Error(500, absl::StrCat("internal error: ", e.what()));
    }
  }
}

// A choice's request that this router sent itself (RunChoices): its target's query is
// this process's choice token, which no client can know.
bool Router::Impl::IsChoiceOfThisRouter(const std::string& target) const {
  const size_t q = target.find('?');
  return q != std::string::npos &&
         target.compare(q + 1, std::string::npos, absl::StrCat(kChoiceQuery, choice_token_)) == 0;
}

bool Router::Impl::Stopping() {
  kvwire::MutexLock lock(&mu_);
  return stopping_;
}

// The prefill server's connector address (its /health), cached.
absl::StatusOr<std::string> Router::Impl::KvAddress(const std::string& server,
                                                    absl::Time deadline) {
  {
    kvwire::MutexLock lock(&mu_);
    auto it = kv_address_.find(server);
    if (it != kv_address_.end()) return it->second;
  }
  HttpCallOptions o;
  o.deadline = std::min(deadline, absl::Now() + absl::Seconds(10));
  o.body_limit = options_.max_upstream_body;
  absl::StatusOr<HttpResponse> r = HttpCall(server, "GET", "/health", "", o);
  if (!r.ok()) return r.status();
  json j = json::parse(r->body, nullptr, false);
  if (r->status != 200 || j.is_discarded() || !j.is_object() || !j.contains("kv_address") ||
      !j["kv_address"].is_string()) {
    return absl::AbortedError(absl::StrCat("prefill ", server, " /health has no kv_address"));
  }
  kvwire::MutexLock lock(&mu_);
  kv_address_[server] = j["kv_address"].get<std::string>();
  return kv_address_[server];
}

void Router::Impl::ForgetKvAddress(const std::string& server) {
  kvwire::MutexLock lock(&mu_);
  kv_address_.erase(server);
}

// GET /v1/models: the decode servers' (every server of a deployment runs one model).
void Router::Impl::Models(const std::shared_ptr<Responder>& resp) {
  HttpCallOptions o;
  o.deadline = absl::Now() + std::min(options_.timeout, absl::Seconds(10));
  o.body_limit = options_.max_upstream_body;
  o.cancelled = [&] { return Stopping() || resp->closed(); };
  std::string server;
  absl::StatusOr<HttpResponse> r = TryEach(
      InstanceKind::kDecode,
      [&](const std::string& d) { return HttpCall(d, "GET", "/v1/models", "", o); }, &server);
  if (!r.ok()) {
    if (absl::IsResourceExhausted(r.status())) ++too_large_;
    resp->Error(StatusFor(r.status()), absl::StrCat("decode: ", r.status().message()));
  } else if (r->status != 200) {
    resp->Error(502, absl::StrCat("decode ", server, ": ", UpstreamMessage(*r)));
  } else {
    resp->Respond(200, r->body);
  }
}

absl::StatusOr<std::unique_ptr<Router>> Router::Start(RouterOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<Router>(new Router(std::move(impl)));
}

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Router::~Router() = default;
int Router::port() const { return impl_->port(); }

}  // namespace dsv4::serve
