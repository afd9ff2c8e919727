#include "examples/dsv4/serve/router.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <system_error>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "examples/dsv4/serve/choices.h"
#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/http_server.h"
#include "examples/dsv4/serve/instance_set.h"
#include "src/control/hmac.h"
#include "src/util/json_fields.h"
#include "src/util/log.h"
#include "src/util/mutex.h"

namespace dsv4::serve {

using kvwire::JsonFields;
using kvwire::Kv;
using nlohmann::json;

namespace {

constexpr char kLog[] = "router";

// An error the client gets: HTTP status and message.
struct Failure {
  Failure(int s, std::string m, std::string r = "")
      : status(s), message(std::move(m)), retry_after(std::move(r)) {}
  int status = 502;
  std::string message;
  std::string retry_after;  // an overloaded upstream's Retry-After, passed on
};

// An upstream's error answer as the client's: an overloaded server (503 with Retry-After:
// its admission queue is full or the request waited too long for KV blocks) stays a 503 with
// the same Retry-After, so the client backs off; any other server error is a bad gateway.
Failure UpstreamFailure(const HttpResponse& r, std::string message) {
  if (r.status == 503 && !r.retry_after.empty()) return {503, std::move(message), r.retry_after};
  return {r.status >= 500 ? 502 : r.status, std::move(message), ""};
}

// What the router keeps queued for a streaming client before it stops reading from decode.
constexpr uint64_t kMaxRelayBacklog = 1 << 20;

int StatusFor(const absl::Status& s) {
  if (absl::IsDeadlineExceeded(s)) return 504;
  if (absl::IsUnavailable(s)) return 503;
  return 502;
}

std::string UpstreamMessage(const HttpResponse& r) {
  absl::StatusOr<json> j = kvwire::ParseJsonObject(r.body, "upstream error", kHttpJsonLimits);
  if (j.ok()) {
    JsonFields f(*j, "upstream error");
    std::string message = f.Nested("error", /*required=*/true).String("message");
    if (f.ok() && !message.empty()) return message;
  }
  return r.body.substr(0, 300);
}

// What the router takes from prefill's answer: the kv_transfer_params object (read mode) and
// the kvwire statistics (decode recomputes the first token: none travels). A prefill server
// that answers anything but a completion is a 502, not a crash.
struct PrefillAnswer {
  json kv_transfer_params;  // null when absent
  json stats;               // null when absent
};

absl::StatusOr<PrefillAnswer> ParsePrefillAnswer(const std::string& body) {
  absl::StatusOr<json> j = kvwire::ParseJsonObject(body, "prefill's answer", kHttpJsonLimits);
  if (!j.ok()) return j.status();
  const json& root = *j;
  const auto choices = root.find("choices");
  if (choices == root.end() || !choices->is_array() || choices->empty() ||
      !(*choices)[0].is_object()) {
    return absl::InvalidArgumentError("prefill's answer has no choices[0]");
  }
  PrefillAnswer a;
  JsonFields f(root, "prefill's answer");
  const json* kvp = f.Object("kv_transfer_params", /*required=*/false);
  const json* stats = f.Object("kvwire", /*required=*/false);
  if (!f.ok()) return f.status();
  if (kvp != nullptr) a.kv_transfer_params = *kvp;
  if (stats != nullptr) a.stats = *stats;
  return a;
}

// The query of a choice's request to the router itself: kChoiceQuery and the token.
constexpr char kChoiceQuery[] = "kvwire_choice=";

std::string RandomToken() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&out, absl::Hex(rd(), absl::kZeroPad8));
  return out;
}

}  // namespace

class Router::Impl {
 public:
  explicit Impl(RouterOptions options) : options_(std::move(options)) {}

  absl::Status Start() {
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

  ~Impl() {
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

  int port() const { return port_.load(); }

 private:
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };

  void Handle(const HttpRequest& r, std::shared_ptr<Responder> resp) {
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
      std::string m = "# TYPE kvwire_dsv4_router_requests_total counter\n";
      absl::StrAppend(&m, "kvwire_dsv4_router_requests_total{outcome=\"ok\"} ", ok_.load(), "\n",
                      "kvwire_dsv4_router_requests_total{outcome=\"error\"} ", errors_.load(), "\n",
                      "kvwire_dsv4_router_requests_total{outcome=\"client_gone\"} ",
                      client_gone_.load(), "\n",
                      "# TYPE kvwire_dsv4_router_upstream_too_large_total counter\n",
                      "kvwire_dsv4_router_upstream_too_large_total ", too_large_.load(), "\n",
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
      resp->ErrorRetryAfter(
          503, absl::StrCat("too many requests in flight (", options_.max_inflight, ")"),
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
  void ProxyGuarded(json body, bool stream, Endpoint endpoint,
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
  bool IsChoiceOfThisRouter(const std::string& target) const {
    const size_t q = target.find('?');
    return q != std::string::npos &&
           target.compare(q + 1, std::string::npos, absl::StrCat(kChoiceQuery, choice_token_)) == 0;
  }

  bool Stopping() {
    kvwire::MutexLock lock(&mu_);
    return stopping_;
  }

  // Tries the servers of one kind in round-robin order until one can be reached; `call`
  // returns Unavailable when its server could not be reached (nothing was sent).
  // The order (and the choice) is the instance set's policy; each call counts as outstanding
  // on its server while it runs.
  template <typename Fn>
  absl::StatusOr<HttpResponse> TryEach(InstanceKind kind, Fn call, std::string* chosen) {
    const std::vector<std::string> servers = instances_->Order(kind);
    if (servers.empty()) return absl::UnavailableError(instances_->NoneReason(kind));
    absl::Status last;
    for (const std::string& s : servers) {
      InstanceSet::Ticket ticket = instances_->Acquire(kind, s);
      absl::StatusOr<HttpResponse> r = call(s);
      if (r.ok() || !absl::IsUnavailable(r.status())) {
        *chosen = s;
        return r;
      }
      KVW_LOG(kWarning, kLog) << "server unreachable, trying the next" << Kv("server", s)
                              << Kv("error", r.status().message());
      last = r.status();
    }
    return absl::UnavailableError(absl::StrCat("no server reachable (", last.message(), ")"));
  }

  // The prefill server's connector address (its /health), cached.
  absl::StatusOr<std::string> KvAddress(const std::string& server, absl::Time deadline) {
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

  void ForgetKvAddress(const std::string& server) {
    kvwire::MutexLock lock(&mu_);
    kv_address_.erase(server);
  }

  // GET /v1/models: the decode servers' (every server of a deployment runs one model).
  void Models(const std::shared_ptr<Responder>& resp) {
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

  // The vLLM P/D protocol: the prompt to prefill (do_remote_decode, max_tokens 1, not
  // streamed), then the original request with prefill's kv_transfer_params to decode.
  void Proxy(json body, bool stream, Endpoint endpoint, const std::shared_ptr<Responder>& resp) {
    const std::string api = EndpointPath(endpoint);
    const absl::Time deadline = absl::Now() + options_.timeout;
    const bool write = options_.mode == "write";
    // In write mode the id is a bearer capability between authenticated engines (whoever
    // presents it to prefill first claims the request's KV): 128 bits from the CSPRNG, never a
    // counter or a clock.
    absl::StatusOr<std::string> random = kvwire::control::RandomNonce(16);
    if (!random.ok()) {
      resp->Error(500, absl::StrCat("cannot make a transfer id: ", random.status().message()));
      return;
    }
    const std::string tid = absl::StrCat("rt-", absl::BytesToHexString(*random));
    std::optional<Failure> failure;
    std::string prefill_server, decode_server;
    // Write mode: the decode's blocks are taken from prepare on, so it counts as loaded from
    // then until the request ends.
    InstanceSet::Ticket decode_ticket;
    json decode_params;
    PrefillAnswer prefill_answer;

    // --- write mode: decode prepares first (allocates and sends its block ids to prefill
    // through the connector), so prefill can push each layer as soon as it is computed ---
    auto prefill_body = [&](bool write_mode) {
      json pb = body;
      pb["max_tokens"] = 1;
      if (pb.contains("max_completion_tokens")) pb["max_completion_tokens"] = 1;
      pb["stream"] = false;
      pb.erase("stream_options");
      pb["kv_transfer_params"] =
          write_mode ? json{{"do_remote_decode", true}, {"mode", "write"}, {"transfer_id", tid}}
                     : json{{"do_remote_decode", true}, {"mode", "read"}};
      return pb.dump();
    };
    // Checks prefill's answer: the first token and (read) the kv_transfer_params.
    auto take_prefill = [&](const absl::StatusOr<HttpResponse>& r) {
      if (!r.ok()) {
        if (absl::IsResourceExhausted(r.status())) ++too_large_;
        failure = Failure{StatusFor(r.status()),
                          prefill_server.empty() ? absl::StrCat("prefill: ", r.status().message())
                                                 : absl::StrCat("prefill server ", prefill_server,
                                                                " failed: ", r.status().message())};
        return;
      }
      if (r->status != 200) {
        failure = UpstreamFailure(
            *r, absl::StrCat("prefill ", prefill_server, ": ", UpstreamMessage(*r)));
        return;
      }
      absl::StatusOr<PrefillAnswer> answer = ParsePrefillAnswer(r->body);
      if (!answer.ok()) {
        failure =
            Failure{502, absl::StrCat("prefill ", prefill_server, ": ", answer.status().message())};
        return;
      }
      prefill_answer = *std::move(answer);
      if (!write) {
        const json& kvp = prefill_answer.kv_transfer_params;
        if (!kvp.is_object()) {
          failure = Failure{502, absl::StrCat("prefill ", prefill_server,
                                              " answered without kv_transfer_params")};
        } else if (!kvp.contains("do_remote_prefill") || kvp["do_remote_prefill"] != true) {
          // Decode would run the whole prompt again: a prefill that is not one is an error.
          failure = Failure{502, absl::StrCat("prefill ", prefill_server,
                                              " answered kv_transfer_params without "
                                              "do_remote_prefill: true")};
        } else {
          decode_params = prefill_answer.kv_transfer_params;
        }
      }
    };
    // The client that leaves ends the upstream calls too (their servers notice the closed
    // connection: decode stops generating and frees its blocks).
    auto client_gone = [this, resp] { return Stopping() || resp->closed(); };
    HttpCallOptions call_options;
    call_options.deadline = deadline;
    call_options.body_limit = options_.max_upstream_body;
    call_options.cancelled = client_gone;
    if (write) {
      // Each prefill server at most once: one that cannot be reached is skipped.
      const std::vector<std::string> prefills = instances_->Order(InstanceKind::kPrefill);
      failure = Failure{503, prefills.empty() ? instances_->NoneReason(InstanceKind::kPrefill)
                                              : "no prefill server reachable"};
      for (const std::string& p : prefills) {
        prefill_server = p;
        // Discovered: decode's connector resolves the prefill by its engine id through etcd.
        // With etcd unreachable a decode could not resolve a prefill it has not met yet, so
        // the prefill is named by the kv address it reports, as for a static list.
        const std::string engine_id =
            instances_->directory_reachable() ? instances_->EngineId(prefill_server) : "";
        absl::StatusOr<std::string> kv = engine_id.empty() ? KvAddress(prefill_server, deadline)
                                                           : absl::StatusOr<std::string>("");
        if (!kv.ok()) {
          failure = Failure{StatusFor(kv.status()), absl::StrCat("prefill server ", prefill_server,
                                                                 ": ", kv.status().message())};
          if (absl::IsUnavailable(kv.status())) continue;
          break;
        }
        std::string host;
        int port = 0;
        if (engine_id.empty() && !SplitHostPort(*kv, &host, &port)) {
          ForgetKvAddress(prefill_server);
          failure = Failure{502, absl::StrCat("prefill server ", prefill_server,
                                              " has a malformed kv_address '", *kv, "'")};
          break;
        }
        decode_params = {{"do_remote_prefill", true}, {"mode", "write"}, {"transfer_id", tid}};
        if (engine_id.empty()) {
          decode_params["remote_host"] = host;
          decode_params["remote_port"] = port;
        } else {
          decode_params["remote_engine_id"] = engine_id;  // resolved by decode through etcd
        }
        // The whole request (prompt or messages, max_tokens: decode reserves the blocks of the
        // whole generation when it prepares), so decode prepares for the same tokens.
        json prep_json = body;
        prep_json["kv_transfer_params"] = decode_params;
        prep_json["stream"] = false;
        prep_json.erase("stream_options");
        prep_json.erase("kvwire_prefill");
        const std::string prep_body = prep_json.dump();
        absl::StatusOr<HttpResponse> prep = TryEach(
            InstanceKind::kDecode,
            [&](const std::string& d) {
              return HttpCall(d, "POST", "/v1/kv/prepare", prep_body, call_options);
            },
            &decode_server);
        if (!prep.ok()) {
          if (absl::IsResourceExhausted(prep.status())) ++too_large_;
          failure = Failure{StatusFor(prep.status()),
                            absl::StrCat("decode prepare failed: ", prep.status().message())};
          break;
        }
        if (prep->status != 200) {
          failure = UpstreamFailure(
              *prep, absl::StrCat("decode ", decode_server, ": ", UpstreamMessage(*prep)));
          break;
        }
        failure.reset();
        decode_ticket = instances_->Acquire(InstanceKind::kDecode, decode_server,
                                            /*count_route=*/false);
        InstanceSet::Ticket prefill_ticket =
            instances_->Acquire(InstanceKind::kPrefill, prefill_server);
        absl::StatusOr<HttpResponse> r =
            HttpCall(prefill_server, "POST", api, prefill_body(true), call_options);
        prefill_ticket.Release();
        take_prefill(r);
        if (failure) {
          // Let decode give its blocks back now rather than at its deadline.
          HttpCallOptions o;
          o.deadline = absl::Now() + absl::Seconds(5);
          (void)HttpCall(decode_server, "POST", "/v1/kv/abort", json{{"transfer_id", tid}}.dump(),
                         o);
          if (!r.ok()) ForgetKvAddress(prefill_server);
          if (!r.ok() && absl::IsUnavailable(r.status())) continue;  // gone: try the next
        }
        break;
      }
    } else {
      const std::string pb = prefill_body(false);
      take_prefill(TryEach(
          InstanceKind::kPrefill,
          [&](const std::string& p) { return HttpCall(p, "POST", api, pb, call_options); },
          &prefill_server));
    }

    // --- decode: the original request with prefill's kv_transfer_params, streamed back ---
    bool started = false;
    if (!failure) {
      json db = body;
      db["kv_transfer_params"] = decode_params;
      db.erase("kvwire_prefill");  // prefill's, never the client's
      if (!prefill_answer.stats.is_null()) db["kvwire_prefill"] = prefill_answer.stats;
      std::string collected;
      int status = 0;
      std::string retry_after;
      bool too_large = false;
      auto call = [&](const std::string& d) {
        HttpCallOptions o;
        o.deadline = deadline;
        o.cancelled = client_gone;
        // A stream is relayed, never held, however long; a non-streamed answer is bounded
        // by on_body (max_upstream_body).
        o.body_limit = std::numeric_limits<uint64_t>::max();
        o.on_headers = [&](const HttpResponse& head) {
          status = head.status;
          retry_after = head.retry_after;
          if (stream && head.status == 200) {
            resp->StartEvents();
            started = true;
          }
        };
        o.on_body = [&](std::string_view piece) {
          if (client_gone()) return false;
          if (started) {
            resp->Raw(std::string(piece));
            // Relayed, not held: while the client has not taken what is queued, stop reading
            // from decode (its socket buffers fill and it waits on its writes).
            while (resp->pending_bytes() > kMaxRelayBacklog) {
              if (client_gone() || absl::Now() > deadline) return false;
              absl::SleepFor(absl::Milliseconds(2));
            }
          } else if (collected.size() + piece.size() > options_.max_upstream_body) {
            too_large = true;
            return false;
          } else {
            collected.append(piece);
          }
          return true;
        };
        return HttpCall(d, "POST", api, db.dump(), o);
      };
      absl::StatusOr<HttpResponse> r =
          write ? call(decode_server) : TryEach(InstanceKind::kDecode, call, &decode_server);
      if (too_large) {
        failure = Failure{
            502, absl::StrCat("decode server ", decode_server,
                              ": its answer is larger than the router's limit of ",
                              options_.max_upstream_body, " bytes (--max-upstream-body-mib)")};
        ++too_large_;
      } else if (!r.ok()) {
        failure = Failure{StatusFor(r.status()),
                          decode_server.empty() ? absl::StrCat("decode: ", r.status().message())
                                                : absl::StrCat("decode server ", decode_server,
                                                               " failed: ", r.status().message())};
      } else if (!started) {
        if (status == 200) {
          resp->Respond(200, collected);
        } else {
          HttpResponse head;
          head.status = status;
          head.retry_after = retry_after;
          head.body = collected;
          failure = UpstreamFailure(
              head, absl::StrCat("decode ", decode_server, ": ", UpstreamMessage(head)));
        }
      }
    }

    if (!failure) {
      ++ok_;
      if (started) resp->EndEvents(/*done=*/false);  // decode's own [DONE] went through
      return;
    }
    if (resp->closed()) {
      // Nobody to answer: the upstream calls were cut when the client left.
      ++client_gone_;
      KVW_LOG(kInfo, kLog) << "client went away; upstream request cancelled"
                           << Kv("error", failure->message);
      return;
    }
    ++errors_;
    KVW_LOG(kWarning, kLog) << "request failed" << Kv("status", failure->status)
                            << Kv("error", failure->message);
    if (started) {
      // Headers are out: the error travels as an event, and the stream ends without [DONE].
      resp->Event(ErrorJson(failure->status, failure->message));
      resp->EndEvents(/*done=*/false);
    } else if (!failure->retry_after.empty()) {
      int64_t seconds = 1;
      if (!absl::SimpleAtoi(failure->retry_after, &seconds)) seconds = 1;
      resp->ErrorRetryAfter(failure->status, failure->message,
                            absl::Seconds(std::clamp<int64_t>(seconds, 1, 3600)));
    } else {
      resp->Error(failure->status, failure->message);
    }
  }

  const RouterOptions options_;
  // Request handlers run on the server's threads and must not touch server_ (assigned after
  // Start, reset at shutdown while a late request may still be handled).
  std::atomic<int> port_{0};
  std::unique_ptr<HttpServer> server_;
  kvwire::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> kv_address_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> inflight_{0};
  // Marks the choices' requests to this router (IsChoiceOfThisRouter): 128 random bits.
  const std::string choice_token_ = RandomToken();
  std::atomic<uint64_t> ok_{0}, errors_{0}, client_gone_{0}, too_large_{0};
  std::unique_ptr<InstanceSet> instances_;  // outlives the request threads (joined first)
};

absl::StatusOr<std::unique_ptr<Router>> Router::Start(RouterOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<Router>(new Router(std::move(impl)));
}

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Router::~Router() = default;
int Router::port() const { return impl_->port(); }

}  // namespace dsv4::serve
