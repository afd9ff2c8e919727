// `kvwire-dsv4 serve`: one model instance behind the HTTP API, in the role of a prefill, a
// decode, or a whole ("both") server, with its paged KV cache registered with a
// kvwire::Connector.
//
// One worker thread owns the model, the cache's allocations and the connector's scheduler
// and worker calls (like vLLM's engine core); the HTTP thread only queues jobs and reads
// counters. Requests interleave one token at a time.
//
// The HTTP surface is vLLM's (POST /v1/completions and /v1/chat/completions, GET /v1/models),
// and so is the P/D protocol: a vLLM-style proxy drives a prefill and a decode server unchanged.
//
//   prefill (kv_transfer_params.do_remote_decode): runs the prompt, samples the first token;
//     read: RequestFinished returns the kv_transfer_params for decode and the blocks stay
//     held until decode's release (GetFinished: finished_sending) or the lease ends;
//     write: SaveKvLayer from Forward's per-layer callback streams each layer to the decode
//     blocks named through the connector.
//   decode (kv_transfer_params.do_remote_prefill): allocates, loads the KV of all prompt
//     tokens but the last through the connector, runs the last one again for the logits of
//     the first token (as vLLM does: no sampled token travels), then continues at position N
//     — the same sequence as `generate` in one process.
//   POST /v1/kv/prepare (decode, write mode): allocate and announce the blocks to prefill
//     before prefill runs, so layers stream while the next one computes;
//   POST /v1/kv/abort: give a prepared request's blocks back.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_MODEL_SERVER_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_MODEL_SERVER_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dsv4::serve {

struct ModelServerOptions {
  std::string role = "both";  // prefill | decode | both
  std::string config_path;
  std::string weights_path;
  std::string host = "127.0.0.1";
  int port = 0;
  std::string kv_host = "127.0.0.1";
  int kv_port = 0;
  std::string transport = "auto";  // auto | tcp | shm
  std::string mode = "auto";       // read | write | auto
  // Blocks per paged cache group; 0: room for min(max_requests, 4) requests of max_seq_len
  // tokens. Memory: the start-up line prints the bytes of one block (over every group and
  // layer) and of one state slot; see README "Capacity".
  uint64_t num_blocks = 0;
  // State slots per state group: requests that hold KV at once (prefill: read-mode hand-offs
  // waiting for their reader count too).
  uint64_t max_requests = 32;
  // Admission: requests that wait for KV blocks at once, and how long each may wait, before
  // they are answered 503 with Retry-After.
  uint64_t max_queue = 128;
  absl::Duration max_queue_wait = absl::Seconds(30);
  uint64_t allocation_seed = 0;  // 0: by role (prefill and decode differ)
  // The most logprobs a request may ask for per token (vLLM's --max-logprobs); -1: the vocabulary.
  int64_t max_logprobs = 20;
  int threads = 0;
  absl::Duration request_timeout = absl::Seconds(60);
  absl::Duration peer_lease = absl::Seconds(5);
  // HTTP connections open at once from one source address (HttpServerOptions). A model
  // server's clients are routers, each one address with a connection per request in flight:
  // above a router's --max-inflight (64), below the server's 256 connections.
  int max_connections_per_source = 128;
  // --verify-kv: the KV engine checks every op end to end (EngineOptions::verify_checksums;
  // either side asking is enough for a pair).
  bool verify_kv = false;
  // Fault injection (tests): corrupt one received KV page after each load.
  bool corrupt_kv_page = false;
  // Test hook: sleep this long after every layer of a prefill and every decode step, so a
  // test can kill a server while a request is surely in flight.
  int inject_delay_ms = 0;
  std::string name;
  // Discovery: register in etcd (endpoints, cluster name) with a lease of etcd_lease_s.
  std::string etcd, cluster;
  int64_t etcd_lease_s = 10;
  // etcd's own authentication and TLS (--etcd-user, --etcd-password(-file), --etcd-cacert,
  // --etcd-cert, --etcd-key), handed to the connector's ConnectorOptions.
  std::string etcd_user, etcd_password, etcd_ca_file, etcd_cert_file, etcd_key_file;
  // The deployment's shared secret for the connector's peers; unset: KVWIRE_SECRET (if any).
  std::optional<std::string> shared_secret;
};

class ModelServer {
 public:
  static absl::StatusOr<std::unique_ptr<ModelServer>> Start(const ModelServerOptions& options);
  ~ModelServer();
  ModelServer(const ModelServer&) = delete;
  ModelServer& operator=(const ModelServer&) = delete;

  int port() const;
  std::string kv_address() const;
  // The KV cache's size and what it costs in memory, and the admission bounds, in one line.
  std::string capacity() const;

  class Impl;

 private:
  explicit ModelServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_MODEL_SERVER_H_
