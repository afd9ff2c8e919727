// kvwire::Connector: moves a request's KV cache from a prefill instance to a decode instance.
//
// Shaped after vLLM's KVConnectorBase_V1 so that a thin Python class maps onto it one to one:
//   scheduler side: GetNumNewMatchedTokens, UpdateStateAfterAlloc, BuildConnectorMeta,
//                   RequestFinished
//   worker side:    RegisterKvCaches, BindConnectorMeta, StartLoadKv, WaitForLayerLoad,
//                   SaveKvLayer, WaitForSave, GetFinished
// One Connector serves both halves in one process; the metadata between them is JSON, so the
// halves can also live in different processes.
//
// Modes (this comment is their reference; README.md "Using kvwire from vLLM" shows them in use):
//   read  - prefill keeps the blocks after RequestFinished and returns kv_transfer_params;
//           decode READs them and sends a release; prefill then reports the request in
//           finished_sending (or when its lease expires).
//   write - decode allocates first and sends its block ids to prefill; SaveKvLayer(layer)
//           WRITEs that layer's blocks; decode is notified once after the last layer.
// The mode is settled per peer pair at handshake (read | write | auto on each side); a
// request may override it through kv_transfer_params "mode".
//
// Block ownership stays with the caller (the scheduler's block pool): the connector reports
// through GetFinished when blocks it was using may be freed. A request in finished_sending /
// finished_recving / failed_loads is done with its blocks; until then they are in use.
#ifndef KVWIRE_CONNECTOR_H_
#define KVWIRE_CONNECTOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"

namespace kvwire {

enum class KvMode : uint32_t { kAuto = 0, kRead = 1, kWrite = 2 };
const char* KvModeName(KvMode mode);
absl::StatusOr<KvMode> ParseKvMode(const std::string& name);
// Settles the mode of a pair; a conflict names both settings.
absl::StatusOr<KvMode> NegotiateKvMode(KvMode prefill, KvMode decode);

// A further prefill rank holding part of a request's KV: with tensor-parallel MHA and fewer
// decode ranks than prefill ranks, one decode rank reads its heads from several prefill ranks.
struct KvSource {
  std::string engine_id;
  std::string host;
  int port = 0;
  std::string transfer_id;
  BlockTable block_ids;
};

// What travels from prefill to decode (through the router) in kv_transfer_params. The JSON
// names are vLLM's P/D connectors' (NIXL, MoRIIO) where they have one: remote_engine_id,
// remote_host, remote_port, remote_block_ids, remote_request_id / transfer_id, tp_size,
// do_remote_prefill, do_remote_decode; nulls and unknown fields read as absent. kvwire's own
// names (engine_id, block_ids) and extras (mode, num_tokens, tp_sources) are accepted too.
struct KvTransferParams {
  std::string engine_id;  // prefill engine name ("remote_engine_id"; also "engine_id")
  std::string host;       // prefill control-channel host
  int port = 0;
  // Unique per request and prefill engine ("transfer_id"; when absent, "remote_request_id").
  std::string transfer_id;
  // The prefill's request id, as vLLM's connectors send it (informational; may be empty).
  std::string remote_request_id;
  int tp_size = 1;  // prefill tensor-parallel size
  KvMode mode = KvMode::kAuto;
  uint64_t num_tokens = 0;  // prompt tokens whose KV prefill computes
  // Prefill's blocks per group (read mode). "remote_block_ids" may be an object {group: ids},
  // one flat list (group "0") or one list per group (groups "0", "1", ... in order, as vLLM
  // lists a request's blocks per KV cache group); "block_ids" is an object.
  BlockTable block_ids;
  bool do_remote_decode = false;   // prefill side: decode happens elsewhere
  bool do_remote_prefill = false;  // decode side: KV comes from a prefill engine
  // Read mode: the other prefill tensor-parallel ranks of the request ("tp_sources"). Decode
  // reads from every rank the heads its own layout holds; groups replicated on every rank
  // (MLA, DeepSeek-V4) come from the first rank only.
  std::vector<KvSource> tp_sources;

  // Adds another prefill rank's read-mode hand-off of the same request as a source.
  void AddTpSource(const KvTransferParams& rank);

  std::string ToJson() const;
  // Validates: an error says which field is missing or malformed.
  static absl::StatusOr<KvTransferParams> FromJson(const std::string& json);
};

struct ConnectorOptions {
  // Role of this instance: "prefill", "decode" or "both".
  std::string role = "both";
  // Modes this side accepts: kAuto accepts both and lets the peer or the request choose.
  KvMode mode = KvMode::kAuto;
  // The engine the connector creates (its name is the engine id in kv_transfer_params).
  EngineOptions engine;
  // A request's whole transfer must end within this (decode: load; prefill: the lease on
  // blocks held for a reader, and waiting for the decode's block ids in write mode).
  absl::Duration request_timeout = absl::Seconds(60);
  // Deadline of the connector handshake with a new peer.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // "host:port" of an HTTP endpoint serving GET /metrics (Prometheus text) and
  // GET /stats.json; port 0 picks a free one (see metrics_address()). Empty: none.
  std::string metrics_address;
  // Optional discovery through etcd (v3 API): "http://host:port[,http://host:port...]" of
  // the cluster's members, and the deployment's name (keys live under
  // /kvwire/<cluster>/instances/<engine id>). With both set, Announce() registers this engine
  // with a lease, and kv_transfer_params that name a remote prefill by engine_id alone (no
  // remote_host/remote_port) are resolved through etcd. Empty: host:port only, as before.
  std::string etcd_endpoints;
  std::string cluster;
  absl::Duration etcd_call_timeout = absl::Seconds(2);  // every etcd call
  int64_t etcd_lease_seconds = 10;                      // how long a dead instance stays registered
  // etcd's own authentication (`etcdctl auth enable`): a user and its password (both, or
  // neither). TLS (https:// endpoints): the CA that signed the members' certificates (PEM;
  // empty: the system's CAs), and a client certificate and its key (PEM files, both or
  // neither) for members started with --client-cert-auth. Connector::Create checks them; a
  // refused login is an error there. FromEnvironment takes them from KVWIRE_ETCD_*.
  std::string etcd_user;
  std::string etcd_password;
  std::string etcd_ca_file;
  std::string etcd_cert_file;
  std::string etcd_key_file;
  // READs of this instance's KV need the request's grant (docs/SECURITY.md, "Read grants"): a
  // peer reads only the blocks of a request handed to it, and none after their release. The
  // price: the target checks each op. shm never maps the KV: its owner copies each op through
  // a staging memfd (served copies: two memcpys instead of one); rdma never READs it, so those
  // READs go over tcp (write mode keeps rdma). false: every peer holding the deployment's
  // secret may READ the whole KV zero-copy over shm and rdma, as with NIXL and Mooncake.
  bool read_grants = true;

  // The KVWIRE_* environment over `base`, and the one reader of it (neither Connector::Create
  // nor the etcd client reads the environment; the C ABI's kvw_options_from_environment and
  // Python's ConnectorOptions.from_environment call this). The engine's variables go through
  // EngineOptions::FromEnvironment (kvwire/engine.h lists them); then each of the connector's
  // that is set and non-empty replaces base's value, as etcdctl reads ETCDCTL_*:
  //   KVWIRE_ETCD_USER          etcd_user
  //   KVWIRE_ETCD_PASSWORD      etcd_password
  //   KVWIRE_ETCD_PASSWORD_FILE etcd_password: the file's first line (when KVWIRE_ETCD_PASSWORD
  //                             is not set)
  //   KVWIRE_ETCD_CACERT        etcd_ca_file
  //   KVWIRE_ETCD_CERT          etcd_cert_file
  //   KVWIRE_ETCD_KEY           etcd_key_file
  // A value that cannot be taken (a password file that cannot be read) is InvalidArgument
  // naming the variable. Ranges are Connector::Create's.
  static absl::StatusOr<ConnectorOptions> FromEnvironment(ConnectorOptions base);
};

struct MatchResult {
  uint64_t num_external_tokens = 0;  // tokens the connector will load
  bool load_async = false;
};

struct RequestFinishedResult {
  bool delay_free = false;         // blocks stay in use until GetFinished reports it
  std::string kv_transfer_params;  // JSON for the decode side (empty if none)
};

struct FailedLoad {
  std::string request_id;
  std::string reason;
};

struct FinishedRequests {
  std::vector<std::string> finished_sending;  // prefill: blocks may be freed
  std::vector<std::string> finished_recving;  // decode: KV is in place
  std::vector<FailedLoad> failed_loads;       // decode: blocks may be freed; recompute
};

// A registered memory range backing the layout: host memory (kHost), or device memory of the
// connector's GPU runtime (kGpu; gpu_device -1 asks the runtime which device holds it).
struct KvMemory {
  void* ptr = nullptr;
  size_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  int gpu_device = -1;
};

// A GPU event the engine recorded on its compute stream after a layer's KV was written: the
// runtime's own handle (cudaEvent_t / hipEvent_t) and its device. It belongs to the runtime
// the connector was created with (gpu::DefaultRuntime() at Connector::Create). The engine keeps
// it alive and does not record it again until WaitForSave returns, even when the requests
// saving it ended sooner (the connector's waiter may be querying it at that moment).
struct GpuEvent {
  void* handle = nullptr;
  int device = 0;
};

class Connector {
 public:
  // Checks every option first (the connector's and its engine's, as Engine::Create does):
  // a value out of range or inconsistent with another is InvalidArgument naming the option
  // ("request_timeout: 0 is out of range (1ms..24h)"), never clamped.
  static absl::StatusOr<std::unique_ptr<Connector>> Create(ConnectorOptions options);
  ~Connector();
  Connector(const Connector&) = delete;
  Connector& operator=(const Connector&) = delete;

  Engine& engine();
  const std::string& engine_id() const;
  // Where the metrics endpoint listens ("" when ConnectorOptions::metrics_address is empty).
  std::string metrics_address() const;

  // --- worker side ---
  // Registers the memory behind `layout` (every layer base must lie inside one range).
  absl::Status RegisterKvCaches(const Layout& layout, const std::vector<KvMemory>& memory);

  // --- scheduler side ---
  // `kv_transfer_params` is the request's JSON (may be empty). Decode: how many tokens come
  // from the prefill instance. Prefill: 0, but a write-mode request is remembered.
  absl::StatusOr<MatchResult> GetNumNewMatchedTokens(const std::string& request_id,
                                                     uint64_t num_tokens,
                                                     uint64_t num_computed_tokens,
                                                     const std::string& kv_transfer_params);
  // Blocks allocated for the request (all its logical blocks, -1 where none).
  absl::Status UpdateStateAfterAlloc(const std::string& request_id, const BlockTable& blocks,
                                     uint64_t num_external_tokens);
  // The work of this step for the worker side, as JSON.
  std::string BuildConnectorMeta();
  // The request ended on this side (`aborted`: it did not complete). Prefill with
  // do_remote_decode in `kv_transfer_params`: its KV covers `num_tokens` tokens; returns
  // delay_free and, in read mode, the kv_transfer_params for decode. Decode: an unfinished
  // load is aborted (delay_free until GetFinished reports it).
  // `transfer_id`: read mode, the id to hold the blocks under (the caller made it unguessable,
  // e.g. a scheduler in another process that already handed it out); empty: a random one.
  absl::StatusOr<RequestFinishedResult> RequestFinished(const std::string& request_id,
                                                        const BlockTable& blocks,
                                                        uint64_t num_tokens,
                                                        const std::string& kv_transfer_params,
                                                        bool aborted = false,
                                                        const std::string& transfer_id = "");

  // --- worker side ---
  absl::Status BindConnectorMeta(const std::string& meta_json);
  // Starts the loads of the bound metadata (decode).
  absl::Status StartLoadKv();
  // Waits (up to the request deadline) until `layer` of every loading request is in place, or
  // the request failed (GetFinished reports it). Layers arrive one by one (read mode: one
  // transfer per layer; write mode: prefill reports each layer once its WRITE is
  // acknowledged), so an engine computes layer i while later layers still load. A GPU engine
  // has nothing to wait for on a stream after this returns: the transport has finished its
  // device copies (synchronized on its own stream) before the layer counts as in place, so
  // the bytes are in device memory and any later kernel on any stream sees them.
  absl::Status WaitForLayerLoad(int layer);
  // Prefill, write mode: the KV of `layer` is final; its blocks go out now (after the
  // event-gated saves issued before it, so that layers go out in order).
  absl::Status SaveKvLayer(int layer);
  // Prefill, write mode: the KV of `layer` is final once `ready` has completed on the GPU.
  // Returns at once, never blocking the caller or the compute stream: the connector waits for
  // the event on its own thread, then sends the layer's blocks as SaveKvLayer(layer) does.
  // Layers go out in the order of these calls. A request that fails meanwhile (deadline,
  // abort, peer death) stops waiting for the event.
  absl::Status SaveKvLayer(int layer, GpuEvent ready);
  // Waits until the saves issued so far (event-gated ones included: their events completed,
  // or their requests ended) have been handed to the transport; bounded by the request
  // deadline.
  absl::Status WaitForSave();
  FinishedRequests GetFinished();

  // Aborts a request on this side (either role); the peer is told. Blocks are reported
  // through GetFinished once nothing touches them any more.
  absl::Status Abort(const std::string& request_id);
  // Decode: this engine will not load the KV the prefill holds for `kv_transfer_params`
  // (do_remote_prefill; it found the prompt in its own prefix cache, or the request ended
  // before its load started). Connects to the prefill rank(s) and tells them to free the
  // blocks now (they count it as released) instead of at the end of their lease.
  absl::Status ReleaseUnread(const std::string& request_id, const std::string& kv_transfer_params,
                             const std::string& reason);

  // Discovery (ConnectorOptions::etcd_endpoints): registers this engine (role, control
  // address, transports, compatibility hash, layout summary, and `http_address` of the
  // serving API when there is one) and keeps the registration alive until the connector is
  // destroyed, which deletes it at once. etcd unreachable now: FailedPrecondition without
  // etcd configured; otherwise OK with the error logged, and registration keeps trying in the
  // background. Call after RegisterKvCaches (the layout is part of the record).
  absl::Status Announce(const std::string& http_address = "");
  // Whether the registration is in etcd now (false without Announce or while etcd is away).
  bool Announced() const;

  // Requests still holding blocks (for accounting checks).
  size_t LiveRequests() const;
  // Per-request timings and per-group bytes/ops, and totals.
  std::string StatsJson() const;
  std::string StatsPrometheus() const;

  class Impl;

 private:
  explicit Connector(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvwire

#endif  // KVWIRE_CONNECTOR_H_
