// The disaggregation proxy in front of prefill and decode servers, like vLLM's P/D proxy:
// round robin over each kind, and per request
//   read mode:  prefill (max_tokens 1, do_remote_decode) returns the first token and
//               kv_transfer_params; decode then loads the KV and continues;
//   write mode: decode prepares (allocates, sends its block ids to prefill through the
//               connector), prefill runs and pushes each layer as it completes, then decode
//               continues from the first token.
// Decode's answer (server-sent events when the client streams) goes back to the client. A
// server that cannot be reached is skipped for the next one of its kind; one that fails
// mid-request gives the client 502 (or an error event once a stream has started).
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_ROUTER_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_ROUTER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/discovery/etcd_client.h"

namespace dsv4::serve {

struct RouterOptions {
  std::vector<std::string> prefill;  // host:port of each prefill server
  std::vector<std::string> decode;
  // Discovery instead of the lists: etcd endpoints and cluster (see instance_set.h).
  std::string etcd, cluster;
  // etcd's authentication and TLS (user and password, CA, client certificate).
  kvwire::discovery::EtcdOptions etcd_access;
  // The deployment's shared secret: instances discovered through etcd are routed to only
  // once they prove they hold it (instance_set.h). Empty: etcd records are trusted.
  std::string secret;
  absl::Duration forget_instance_after = absl::Seconds(30);  // InstanceSetOptions::forget_after
  std::string policy;         // round_robin | least_loaded (empty: least_loaded with etcd)
  std::string mode = "read";  // read | write
  std::string host = "127.0.0.1";
  int port = 0;
  absl::Duration timeout = absl::Seconds(300);  // whole request
  int max_inflight = 64;
  // Client connections open at once from one source address (HttpServerOptions).
  int max_connections_per_source = 64;
  // The largest upstream answer the router holds whole (every non-streamed answer: prefill's,
  // decode's, prepare's): a larger one is cut and the client gets 502 (counted as
  // kvwire_dsv4_router_upstream_too_large_total). Streamed answers are relayed as they come,
  // never held: the router reads from decode only as fast as the client takes them.
  uint64_t max_upstream_body = 8ull << 20;
};

class Router {
 public:
  static absl::StatusOr<std::unique_ptr<Router>> Start(RouterOptions options);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;
  int port() const;

  class Impl;

 private:
  explicit Router(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_ROUTER_H_
