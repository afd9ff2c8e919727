// Router::Impl (router.h), shared by the files that implement it, one job each:
//   router.cc        start-up and shutdown, the HTTP surface (routes, admission by requests
//                    in flight, /health, /metrics, /v1/models), a thread per request
//   router_proxy.cc  the vLLM P/D protocol of one request: prefill (read mode), or decode's
//                    prepare then prefill (write mode), then decode's answer relayed
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_ROUTER_IMPL_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_ROUTER_IMPL_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "examples/dsv4/serve/completion_api.h"
#include "examples/dsv4/serve/http_client.h"
#include "examples/dsv4/serve/http_server.h"
#include "examples/dsv4/serve/instance_set.h"
#include "examples/dsv4/serve/router.h"
#include "src/util/log.h"
#include "src/util/mutex.h"

namespace dsv4::serve {

class Router::Impl {
 public:
  explicit Impl(RouterOptions options) : options_(std::move(options)) {}
  ~Impl();

  absl::Status Start();
  int port() const { return port_.load(); }

 private:
  static constexpr char kLog[] = "router";

  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };

  // --- router.cc ------------------------------------------------------------------------------
  void Handle(const HttpRequest& r, std::shared_ptr<Responder> resp);
  void ProxyGuarded(nlohmann::json body, bool stream, Endpoint endpoint,
                    const std::shared_ptr<Responder>& resp);
  bool IsChoiceOfThisRouter(const std::string& target) const;
  bool Stopping();
  absl::StatusOr<std::string> KvAddress(const std::string& server, absl::Time deadline);
  void ForgetKvAddress(const std::string& server);
  void Models(const std::shared_ptr<Responder>& resp);
  // The HTTP status a failed upstream call answers the client with.
  static int StatusFor(const absl::Status& s);
  // An upstream's error message (its JSON error's, else the start of its body).
  static std::string UpstreamMessage(const HttpResponse& r);
  // 128 random bits as hex.
  static std::string RandomToken();

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
      KVW_LOG(kWarning, kLog) << "server unreachable, trying the next" << kvwire::Kv("server", s)
                              << kvwire::Kv("error", r.status().message());
      last = r.status();
    }
    return absl::UnavailableError(absl::StrCat("no server reachable (", last.message(), ")"));
  }

  // --- router_proxy.cc ------------------------------------------------------------------------
  void Proxy(nlohmann::json body, bool stream, Endpoint endpoint,
             const std::shared_ptr<Responder>& resp);

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

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_ROUTER_IMPL_H_
