/* kvwire C API: the engine, the KV connector and the layouts they need, for C programs and
 * dlopen-style plugins. It mirrors kvwire/engine.h, kvwire/connector.h and kvwire/layout.h
 * call for call; every option of EngineOptions and ConnectorOptions has a setter.
 *
 * Conventions (as in LevelDB's c.h):
 *  - Every type is opaque; every object made by kvw_*_create / returned as a pointer is freed
 *    by its kvw_*_destroy; strings returned as char* are freed with kvw_free.
 *  - Fallible calls take `char** errptr`. On success *errptr is left alone; on failure it is
 *    set to a malloc'd message (a previous message is freed first) and the call returns a
 *    non-zero error code (an absl::StatusCode value: 3 invalid argument, 4 deadline exceeded,
 *    5 not found, 9 failed precondition, 14 unavailable ...) or NULL. No exception crosses
 *    this boundary.
 *  - Calls that take errptr check their pointer arguments: a NULL that the call needs is
 *    reported as an error (code 3, the message names the argument), never dereferenced;
 *    errptr itself may be NULL (the message is dropped, the code still returned). Calls
 *    without errptr take a NULL handle too: getters return 0 / NULL, setters and destroys do
 *    nothing (kvw_block_table_set also ignores NULL ids with a non-zero count).
 *  - Block tables are passed as kvw_block_table_t (group name -> block ids, -1 = none).
 *  - Engine option setters store what they are given (refusing only a value the option's C++
 *    type cannot hold, or text that does not parse); kvw_engine_create and
 *    kvw_connector_create hand the options to Engine::Create, the one place every engine option
 *    is checked, which refuses a value out of range with code 3 and "<option>: <value> is out
 *    of range (<lo>..<hi>)", the same message C++ and Python give. Each transport's options
 *    are set by name (kvw_engine_options_set_transport_option: "tcp", "io_poll", "50us"),
 *    for a built-in transport or any other, and named "<transport>.<key>" in errors. Other setters
 * that take errptr check the value's range before storing it (code 3, the message names the setter,
 * the value and the accepted range). Durations are milliseconds.
 *  - Transports are named by strings ("auto", "tcp", "shm", "rdma", or an outside transport's
 *    name), checked by kvw_engine_create.
 *  - Statistics and peer lists come out as JSON text (freed with kvw_free): fields may be
 *    added without breaking a C caller.
 */
#ifndef KVWIRE_KVWIRE_H_
#define KVWIRE_KVWIRE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvw_layout_t kvw_layout_t;
typedef struct kvw_options_t kvw_options_t;
typedef struct kvw_connector_t kvw_connector_t;
typedef struct kvw_block_table_t kvw_block_table_t;
typedef struct kvw_finished_t kvw_finished_t;
typedef struct kvw_buffer_t kvw_buffer_t;
typedef struct kvw_engine_options_t kvw_engine_options_t;
typedef struct kvw_engine_t kvw_engine_t;
typedef struct kvw_region_options_t kvw_region_options_t;
typedef struct kvw_connect_options_t kvw_connect_options_t;
typedef struct kvw_transfer_options_t kvw_transfer_options_t;
typedef struct kvw_notifications_t kvw_notifications_t;
typedef struct kvw_inbox_t kvw_inbox_t;
typedef struct kvw_inbox_events_t kvw_inbox_events_t;

/* One one-sided operation (kvwire::Op). READ copies remote -> local, WRITE local -> remote. */
typedef struct kvw_op_t {
  uint64_t local_region;
  uint64_t local_offset;
  uint64_t remote_region; /* an id the peer exported to this engine */
  uint64_t remote_offset;
  uint64_t length;
} kvw_op_t;

enum {
  KVW_OK = 0,
  KVW_MODE_AUTO = 0,
  KVW_MODE_READ = 1,
  KVW_MODE_WRITE = 2,
  KVW_FINISHED_SENDING = 0,
  KVW_FINISHED_RECVING = 1,
  KVW_FAILED_LOADS = 2,
  KVW_MEMORY_HOST = 0,
  KVW_MEMORY_GPU = 1,
  KVW_OP_READ = 0,
  KVW_OP_WRITE = 1,
  KVW_TRANSFER_PENDING = 0,
  KVW_TRANSFER_SUCCEEDED = 1,
  KVW_TRANSFER_FAILED = 2,
  /* Access rights a peer gets to a region (kvwire::Access). */
  KVW_ACCESS_NONE = 0,
  KVW_ACCESS_REMOTE_READ = 1,
  KVW_ACCESS_REMOTE_WRITE = 2,
  KVW_ACCESS_REMOTE_READ_WRITE = 3,
  KVW_INBOX_MESSAGE = 0,
  KVW_INBOX_PEER_CLOSED = 1,
};

const char* kvw_version(void);
void kvw_free(void* ptr);

/* --- shareable host memory (reachable by a peer on the same host through shm) --- */
kvw_buffer_t* kvw_buffer_create(size_t length, char** errptr);
void* kvw_buffer_data(const kvw_buffer_t* buffer);
size_t kvw_buffer_size(const kvw_buffer_t* buffer);
void kvw_buffer_destroy(kvw_buffer_t* buffer);

/* --- layouts --- */
kvw_layout_t* kvw_layout_preset(const char* name, char** errptr);
kvw_layout_t* kvw_layout_from_json(const char* json, char** errptr);
char* kvw_layout_to_json(const kvw_layout_t* layout);
/* Lays the groups out from `base` (see AssignBacking); returns the bytes needed. */
uint64_t kvw_layout_assign_backing(kvw_layout_t* layout, uint64_t base, uint64_t num_blocks,
                                   uint64_t state_blocks);
size_t kvw_layout_num_groups(const kvw_layout_t* layout);
const char* kvw_layout_group_name(const kvw_layout_t* layout, size_t group);
uint64_t kvw_layout_group_page_bytes(const kvw_layout_t* layout, size_t group);
int kvw_layout_group_tokens_per_block(const kvw_layout_t* layout, size_t group);
int kvw_layout_group_is_state(const kvw_layout_t* layout, size_t group);
/* Address of block `block` of the group's `layer_index`-th layer, component 0. */
uint64_t kvw_layout_block_address(const kvw_layout_t* layout, size_t group, size_t layer_index,
                                  uint64_t block);
size_t kvw_layout_group_num_layers(const kvw_layout_t* layout, size_t group);
int kvw_layout_check_compatible(const kvw_layout_t* prefill, const kvw_layout_t* decode,
                                char** errptr);
void kvw_layout_destroy(kvw_layout_t* layout);

/* --- block tables --- */
kvw_block_table_t* kvw_block_table_create(void);
void kvw_block_table_set(kvw_block_table_t* table, const char* group, const int64_t* ids,
                         size_t count);
void kvw_block_table_destroy(kvw_block_table_t* table);

/* --- connector options (fields of kvwire::ConnectorOptions) --- */
/* The C++ defaults; the environment is NOT read (see kvw_options_from_environment). NULL
 * only when out of memory. */
kvw_options_t* kvw_options_create(void);
/* ConnectorOptions::FromEnvironment (kvwire/connector.h lists the variables; the engine's are
 * EngineOptions::FromEnvironment's, as kvw_engine_options_from_environment): each KVWIRE_*
 * variable that is set and non-empty (KVWIRE_SECRET, KVWIRE_LISTEN, KVWIRE_ETCD_USER, ...)
 * replaces the current value; setters called after it override it. A bad value: code 3, the
 * message names the variable, and nothing changes. */
int kvw_options_from_environment(kvw_options_t* options, char** errptr);
/* "prefill", "decode" or "both"; KVW_MODE_*. Stored as given: kvw_connector_create refuses
 * another role or mode ("role: ...", "mode: ..."). */
void kvw_options_set_role(kvw_options_t* options, const char* role);
void kvw_options_set_mode(kvw_options_t* options, int mode);
void kvw_options_set_name(kvw_options_t* options, const char* name);
void kvw_options_set_listen_address(kvw_options_t* options, const char* address);
/* "auto", or the name of the transport to force; checked by kvw_connector_create. */
int kvw_options_set_transport(kvw_options_t* options, const char* transport, char** errptr);
/* kvw_engine_options_set_transport_option on the connector's engine options. */
int kvw_options_set_transport_option(kvw_options_t* options, const char* transport, const char* key,
                                     const char* value, char** errptr);
void kvw_options_set_request_timeout_ms(kvw_options_t* options, int64_t ms);
/* The deployment's shared secret: `length` bytes (any bytes; length 0 clears it, and then no
 * peer is asked to prove anything). With a secret, peers prove they know it (HMAC-SHA256
 * challenge-response both ways) before any KV moves, and a peer without it is refused.
 * Overrides KVWIRE_SECRET. Returns non-zero when options, or secret with length > 0, is NULL. */
int kvw_options_set_secret(kvw_options_t* options, const char* secret, size_t length,
                           char** errptr);
/* The rest of ConnectorOptions. */
/* Replaces the engine options the connector will create its engine with (a copy; the
 * name, listen address, transport and secret set above are part of them and are replaced
 * too). */
int kvw_options_set_engine_options(kvw_options_t* options, const kvw_engine_options_t* engine,
                                   char** errptr);
/* The numeric connector options store any value; kvw_connector_create checks every option
 * (ValidateConnectorOptions, as Connector::Create) and refuses one out of range with code 3
 * and a message naming it and its range, e.g. "request_timeout: 0 is out of range
 * (1ms..24h)". request_timeout and handshake_timeout: 1 ms .. 24 h. */
int kvw_options_set_request_timeout(kvw_options_t* options, int64_t ms, char** errptr);
int kvw_options_set_handshake_timeout(kvw_options_t* options, int64_t ms, char** errptr);
// Connector: READs of the KV need the request's grant (1, the default; checked by the target:
// served copies over shm, tcp instead of rdma) or
// not (0: zero-copy shm/rdma READs by any peer holding the secret). Other values: an error.
int kvw_options_set_read_grants(kvw_options_t* options, int on, char** errptr);
/* "host:port" of GET /metrics and /stats.json (port 0: a free one); "" or NULL: none. */
int kvw_options_set_metrics_address(kvw_options_t* options, const char* address, char** errptr);
/* Discovery through etcd (v3 API): "http://host:port[,http://host:port...]" of the cluster's
 * members, and the deployment's name; both set: kvw_connector_announce registers the engine
 * and kv_transfer_params naming a prefill by engine id alone are resolved through etcd.
 * "" or NULL: host:port only. */
int kvw_options_set_etcd_endpoints(kvw_options_t* options, const char* endpoints, char** errptr);
int kvw_options_set_cluster(kvw_options_t* options, const char* cluster, char** errptr);
/* Deadline of every etcd call (1 ms .. 10 min, checked by kvw_connector_create). */
int kvw_options_set_etcd_call_timeout(kvw_options_t* options, int64_t ms, char** errptr);
/* Lease of the registration: how long a dead instance stays registered (1 .. 86400 s, checked
 * by kvw_connector_create; etcd itself may raise it to its minimum TTL). */
int kvw_options_set_etcd_lease_seconds(kvw_options_t* options, int64_t seconds, char** errptr);
/* etcd's own authentication: a user and its password (both, or both NULL/"": none). TLS for
 * https:// endpoints: the CA's PEM file (NULL/"": the system's CAs) and a client certificate
 * and its key (both, or neither). kvw_connector_create refuses half a pair, and credentials
 * without endpoints. kvw_options_from_environment takes them from KVWIRE_ETCD_*. */
int kvw_options_set_etcd_auth(kvw_options_t* options, const char* user, const char* password,
                              char** errptr);
int kvw_options_set_etcd_tls(kvw_options_t* options, const char* ca_file, const char* cert_file,
                             const char* key_file, char** errptr);
void kvw_options_destroy(kvw_options_t* options);

/* --- connector --- */
/* options NULL: the defaults, as kvw_options_create (the environment is not read). */
kvw_connector_t* kvw_connector_create(const kvw_options_t* options, char** errptr);
void kvw_connector_destroy(kvw_connector_t* connector);
const char* kvw_connector_engine_id(const kvw_connector_t* connector);
char* kvw_connector_address(kvw_connector_t* connector);
/* Where the metrics endpoint listens ("" without one); kvw_free it. */
char* kvw_connector_metrics_address(const kvw_connector_t* connector);
/* The connector's engine (Connector::engine()): owned by the connector, valid until
 * kvw_connector_destroy; kvw_engine_destroy on it does nothing. */
kvw_engine_t* kvw_connector_engine(kvw_connector_t* connector);
/* Discovery (kvw_options_set_etcd_endpoints): registers this engine in etcd with a lease kept
 * alive until kvw_connector_destroy, which deletes the key. http_address: the serving API's
 * address to publish (NULL or "": none). Without etcd configured: code 9. etcd unreachable:
 * 0, the error logged, and registration keeps trying in the background. Call after
 * kvw_register_kv_caches (the layout is part of the record). */
int kvw_connector_announce(kvw_connector_t* connector, const char* http_address, char** errptr);
/* 1 while the registration is in etcd, else 0 (also for a NULL connector). */
int kvw_connector_announced(const kvw_connector_t* connector);

/* worker side */
int kvw_register_kv_caches(kvw_connector_t* connector, const kvw_layout_t* layout,
                           void* const* ptrs, const size_t* lengths, size_t count, char** errptr);
/* As kvw_register_kv_caches, with each range's memory kind (KVW_MEMORY_HOST or
 * KVW_MEMORY_GPU; kinds NULL: all host) and GPU device (-1: ask the runtime; gpu_devices
 * NULL: all -1). GPU memory belongs to the connector's GPU runtime. */
int kvw_register_kv_memory(kvw_connector_t* connector, const kvw_layout_t* layout,
                           void* const* ptrs, const size_t* lengths, const int* kinds,
                           const int* gpu_devices, size_t count, char** errptr);

/* scheduler side */
int kvw_get_num_new_matched_tokens(kvw_connector_t* connector, const char* request_id,
                                   uint64_t num_tokens, uint64_t num_computed_tokens,
                                   const char* kv_transfer_params, uint64_t* num_external_tokens,
                                   int* load_async, char** errptr);
int kvw_update_state_after_alloc(kvw_connector_t* connector, const char* request_id,
                                 const kvw_block_table_t* blocks, uint64_t num_external_tokens,
                                 char** errptr);
char* kvw_build_connector_meta(kvw_connector_t* connector);
/* *kv_transfer_params_out is set to a malloc'd JSON string (possibly empty). */
int kvw_request_finished(kvw_connector_t* connector, const char* request_id,
                         const kvw_block_table_t* blocks, uint64_t num_tokens,
                         const char* kv_transfer_params, int aborted, int* delay_free,
                         char** kv_transfer_params_out, char** errptr);

/* As kvw_request_finished, holding read-mode blocks under `transfer_id` (one the caller made
 * unguessable and may already have handed out; NULL or "": a random one). */
int kvw_request_finished_with_transfer_id(kvw_connector_t* connector, const char* request_id,
                                          const kvw_block_table_t* blocks, uint64_t num_tokens,
                                          const char* kv_transfer_params, int aborted,
                                          const char* transfer_id, int* delay_free,
                                          char** kv_transfer_params_out, char** errptr);

/* worker side */
int kvw_bind_connector_meta(kvw_connector_t* connector, const char* meta, char** errptr);
int kvw_start_load_kv(kvw_connector_t* connector, char** errptr);
int kvw_wait_for_layer_load(kvw_connector_t* connector, int layer, char** errptr);
int kvw_save_kv_layer(kvw_connector_t* connector, int layer, char** errptr);
/* The layer's KV is final once `event` (cudaEvent_t / hipEvent_t of the connector's GPU
 * runtime, on `device`) has completed; returns at once, the connector waits on its own thread
 * (see Connector::SaveKvLayer(int, GpuEvent)). event NULL: as kvw_save_kv_layer. */
int kvw_save_kv_layer_event(kvw_connector_t* connector, int layer, void* event, int device,
                            char** errptr);
int kvw_wait_for_save(kvw_connector_t* connector, char** errptr);
kvw_finished_t* kvw_get_finished(kvw_connector_t* connector);
size_t kvw_finished_count(const kvw_finished_t* finished, int kind);
const char* kvw_finished_request(const kvw_finished_t* finished, int kind, size_t index);
/* Reason of failed load `index` (kind KVW_FAILED_LOADS). */
const char* kvw_finished_reason(const kvw_finished_t* finished, size_t index);
void kvw_finished_destroy(kvw_finished_t* finished);

int kvw_abort(kvw_connector_t* connector, const char* request_id, char** errptr);
size_t kvw_live_requests(const kvw_connector_t* connector);
char* kvw_stats_json(const kvw_connector_t* connector);
char* kvw_stats_prometheus(const kvw_connector_t* connector);

/* kv_transfer_params helper: the JSON decode needs for a write-mode request. */
char* kvw_write_mode_params(const char* host, int port, const char* transfer_id,
                            uint64_t num_tokens);

/* ============================== engine (kvwire/engine.h) ============================== */

/* --- engine options (fields of kvwire::EngineOptions) --- */
/* The C++ defaults; the environment is NOT read (see kvw_engine_options_from_environment). */
kvw_engine_options_t* kvw_engine_options_create(void);
/* EngineOptions::FromEnvironment (kvwire/engine.h lists the variables): each KVWIRE_* variable
 * that is set and non-empty replaces the option's current value (the environment wins over
 * what was set before this call; set options after it to override the environment). A bad
 * value: code 3, the message names the variable ("KVWIRE_TCP_CONNECTIONS=0: tcp.connections:
 * 0 is out of range (1..64)"), and the options are left as they were. */
int kvw_engine_options_from_environment(kvw_engine_options_t* options, char** errptr);
void kvw_engine_options_destroy(kvw_engine_options_t* options);
/* Strings: NULL is refused (code 3); "" is a valid value where the C++ option allows it. */
int kvw_engine_options_set_name(kvw_engine_options_t* options, const char* name, char** errptr);
/* "host:port" (port 0: a free one); "": do not listen. */
int kvw_engine_options_set_listen_address(kvw_engine_options_t* options, const char* address,
                                          char** errptr);
/* "auto", or the name of the transport to force ("tcp", "shm", "rdma", an outside one). */
int kvw_engine_options_set_transport(kvw_engine_options_t* options, const char* transport,
                                     char** errptr);
/* `length` bytes of any value; length 0 clears it (no peer is asked to prove anything). */
int kvw_engine_options_set_secret(kvw_engine_options_t* options, const char* secret, size_t length,
                                  char** errptr);
/* One option of one transport, by name, as text: TransportOptions::Set (kvwire/tcp_options.h,
 * shm_options.h, rdma_options.h list them with their ranges). Integers in decimal, durations
 * with a unit ("20us", "5s"), booleans 1/0/true/false, lists comma-separated, e.g.
 * ("tcp", "io_poll", "50us"), ("rdma", "devices", "mlx5_0,mlx5_1:1"), ("shm", "cma", "1").
 * An unknown transport or key, or text that does not parse: code 3 here; a value out of range:
 * code 3 from kvw_engine_create. */
int kvw_engine_options_set_transport_option(kvw_engine_options_t* options, const char* transport,
                                            const char* key, const char* value, char** errptr);
/* Numbers, with the range kvw_engine_create accepts (Engine::Create checks them): */
int kvw_engine_options_set_max_op_bytes(kvw_engine_options_t* o, int64_t v,
                                        char** e); /* 1..64 MiB */
int kvw_engine_options_set_stripe_min_bytes(kvw_engine_options_t* o, int64_t v,
                                            char** e); /* 0..1 TiB */
int kvw_engine_options_set_max_frame_bytes(kvw_engine_options_t* o, int64_t v,
                                           char** e); /* 4 KiB..1 GiB */
int kvw_engine_options_set_heartbeat_interval(kvw_engine_options_t* o, int64_t ms,
                                              char** e); /* 1 ms..1 h */
int kvw_engine_options_set_peer_lease(kvw_engine_options_t* o, int64_t ms,
                                      char** e); /* 1 ms..24 h */
int kvw_engine_options_set_connect_timeout(kvw_engine_options_t* o, int64_t ms,
                                           char** e); /* 1 ms..1 h */
int kvw_engine_options_set_transfer_timeout(kvw_engine_options_t* o, int64_t ms,
                                            char** e); /* 1 ms..24 h */
int kvw_engine_options_set_compat_salt(kvw_engine_options_t* o, uint64_t v, char** e); /* any */
int kvw_engine_options_set_io_threads(kvw_engine_options_t* o, int64_t v, char** e);   /* 1..64 */
int kvw_engine_options_set_max_message_bytes(kvw_engine_options_t* o, int64_t v,
                                             char** e); /* 1..1 GiB */
/* End-to-end CRC32C of every op (EngineOptions::verify_checksums; docs/CHECKSUMS.md). */
int kvw_engine_options_set_verify_checksums(kvw_engine_options_t* o, int64_t on,
                                            char** e); /* 0 or 1 */
int kvw_engine_options_set_max_pending_handshakes(kvw_engine_options_t* o, int64_t v,
                                                  char** e); /* 1..65536 */
int kvw_engine_options_set_max_pending_handshakes_per_source(kvw_engine_options_t* o, int64_t v,
                                                             char** e); /* 1..65536 */
int kvw_engine_options_set_max_control_connections(kvw_engine_options_t* o, int64_t v,
                                                   char** e); /* 1..1048576 */
int kvw_engine_options_set_max_control_send_queue_bytes(kvw_engine_options_t* o, int64_t v,
                                                        char** e); /* 4 KiB..1 TiB */
int kvw_engine_options_set_max_undrained_notifications(kvw_engine_options_t* o, int64_t v,
                                                       char** e); /* 1..2^32 */
int kvw_engine_options_set_closed_peers_kept(kvw_engine_options_t* o, int64_t v,
                                             char** e); /* 0..65536 */

/* --- engine --- */
/* options NULL: the C++ defaults. Options out of range, or that contradict each other, are
 * refused here (code 3, by Engine::Create): max_message_bytes >= max_frame_bytes,
 * max_control_send_queue_bytes < max_frame_bytes + 4, shm.cma together with shm.deny_ptrace,
 * a forced transport with no options of that name. */
kvw_engine_t* kvw_engine_create(const kvw_engine_options_t* options, char** errptr);
void kvw_engine_destroy(kvw_engine_t* engine);
/* Owned by the engine (NULL for a NULL engine). */
const char* kvw_engine_name(const kvw_engine_t* engine);
/* Control-channel address "host:port" ("" when not listening); kvw_free it. NULL for NULL. */
char* kvw_engine_address(const kvw_engine_t* engine);

/* Region options (kvwire::RegionOptions). Defaults: access KVW_ACCESS_REMOTE_READ_WRITE
 * (a peer the region is exported to may read AND write it), host memory, gpu_device -1, not
 * exported to all peers (only to the peers given in Connect or Export). */
kvw_region_options_t* kvw_region_options_create(void);
void kvw_region_options_destroy(kvw_region_options_t* options);
int kvw_region_options_set_access(kvw_region_options_t* options, int access, char** errptr);
int kvw_region_options_set_kind(kvw_region_options_t* options, int kind, char** errptr);
int kvw_region_options_set_gpu_device(kvw_region_options_t* options, int device,
                                      char** errptr); /* -1..1023 */
int kvw_region_options_set_export_to_all_peers(kvw_region_options_t* options, int on,
                                               char** errptr);
/* Registers [ptr, ptr+length) (length > 0); options NULL: the defaults. *region gets its id. */
int kvw_engine_register_memory(kvw_engine_t* engine, void* ptr, size_t length,
                               const kvw_region_options_t* options, uint64_t* region,
                               char** errptr);
int kvw_engine_deregister_memory(kvw_engine_t* engine, uint64_t region, char** errptr);

/* Connect options (kvwire::ConnectOptions): regions exported during the handshake, and a
 * transport forced for this peer (unset: the engine's). */
kvw_connect_options_t* kvw_connect_options_create(void);
void kvw_connect_options_destroy(kvw_connect_options_t* options);
int kvw_connect_options_set_exports(kvw_connect_options_t* options, const uint64_t* regions,
                                    size_t count, char** errptr);
int kvw_connect_options_set_transport(kvw_connect_options_t* options, const char* transport,
                                      char** errptr);
/* options NULL: no exports, the engine's transport. *peer gets the peer id. */
int kvw_engine_connect(kvw_engine_t* engine, const char* address,
                       const kvw_connect_options_t* options, uint64_t* peer, char** errptr);
int kvw_engine_export(kvw_engine_t* engine, uint64_t peer, const uint64_t* regions, size_t count,
                      char** errptr);
int kvw_engine_unexport(kvw_engine_t* engine, uint64_t peer, const uint64_t* regions, size_t count,
                        char** errptr);
/* reason NULL: a plain Disconnect; else the peer gets it in its Goodbye (as an aborted
 * status). */
int kvw_engine_disconnect(kvw_engine_t* engine, uint64_t peer, const char* reason, char** errptr);
/* Peers() as a JSON array of {"id","name","address","transport","alive","close_reason"};
 * kvw_free it. NULL for a NULL engine. */
char* kvw_engine_peers_json(const kvw_engine_t* engine);
int kvw_engine_find_peer(const kvw_engine_t* engine, const char* name, uint64_t* peer,
                         char** errptr);
/* timeout_ms: 0 .. 24 h. */
int kvw_engine_wait_for_peer(kvw_engine_t* engine, const char* name, int64_t timeout_ms,
                             uint64_t* peer, char** errptr);
/* The regions `peer` exported to this engine: the first `capacity` go to ids/lengths/access/
 * kinds (each may be NULL when not wanted; NULL with capacity > 0 is fine), *count gets how
 * many there are (possibly more than capacity). */
int kvw_engine_remote_regions(const kvw_engine_t* engine, uint64_t peer, uint64_t* ids,
                              uint64_t* lengths, uint32_t* access, int* kinds, size_t capacity,
                              size_t* count, char** errptr);
int kvw_engine_wait_for_remote_region(kvw_engine_t* engine, uint64_t peer, uint64_t region,
                                      int64_t timeout_ms, char** errptr);

/* Transfer options (kvwire::TransferOptions). */
kvw_transfer_options_t* kvw_transfer_options_create(void);
void kvw_transfer_options_destroy(kvw_transfer_options_t* options);
/* Delivered to the peer after all data is visible there: `length` bytes (data NULL with
 * length 0: an empty notification, which is still delivered). */
int kvw_transfer_options_set_notification(kvw_transfer_options_t* options, const char* data,
                                          size_t length, char** errptr);
/* Deadline relative to submission (1 ms .. 24 h); unset: the engine's transfer_timeout. */
int kvw_transfer_options_set_timeout(kvw_transfer_options_t* options, int64_t ms, char** errptr);
/* kind: KVW_OP_READ or KVW_OP_WRITE; count 1 .. 1,048,576 ops. *id gets the transfer id. */
int kvw_engine_transfer(kvw_engine_t* engine, uint64_t peer, int kind, const kvw_op_t* ops,
                        size_t count, const kvw_transfer_options_t* options, uint64_t* id,
                        char** errptr);
/* Non-blocking. *state gets KVW_TRANSFER_PENDING / SUCCEEDED / FAILED (a final state is
 * reported once; the transfer is then forgotten). Returns 0 unless the call itself is bad or
 * the transfer failed: then the failure's code, with its message in *errptr. */
int kvw_engine_poll(kvw_engine_t* engine, uint64_t id, int* state, char** errptr);
/* Waits up to timeout_ms (0 .. 24 h) for the transfer to end; its status (4 if the wait itself
 * timed out: the transfer stays pending). */
int kvw_engine_wait(kvw_engine_t* engine, uint64_t id, int64_t timeout_ms, char** errptr);

/* Notifications (kvwire::Notification). */
/* Everything received so far (each once); never NULL for a valid engine (maybe empty). */
kvw_notifications_t* kvw_engine_take_notifications(kvw_engine_t* engine, char** errptr);
/* One notification, waiting up to timeout_ms (0 .. 24 h); NULL with code 4 in *errptr on
 * timeout. */
kvw_notifications_t* kvw_engine_wait_notification(kvw_engine_t* engine, int64_t timeout_ms,
                                                  char** errptr);
size_t kvw_notifications_count(const kvw_notifications_t* n);
/* Out-of-range index or NULL list: 0 / NULL. Strings are owned by the list. */
uint64_t kvw_notifications_peer(const kvw_notifications_t* n, size_t index);
const char* kvw_notifications_peer_name(const kvw_notifications_t* n, size_t index);
uint64_t kvw_notifications_transfer_id(const kvw_notifications_t* n, size_t index);
const char* kvw_notifications_payload(const kvw_notifications_t* n, size_t index, size_t* length);
void kvw_notifications_destroy(kvw_notifications_t* n);

/* Engine messages (SendMessage / OpenInbox): topic 1..64 bytes. */
int kvw_engine_send_message(kvw_engine_t* engine, uint64_t peer, const char* topic,
                            const char* payload, size_t length, char** errptr);
/* max_queued_bytes 0: the default (64 MiB); peer_events non-zero: deliver peer closes too.
 * The inbox may outlive the engine. */
kvw_inbox_t* kvw_engine_open_inbox(kvw_engine_t* engine, const char* topic,
                                   uint64_t max_queued_bytes, int peer_events, char** errptr);
const char* kvw_inbox_topic(const kvw_inbox_t* inbox);
kvw_inbox_events_t* kvw_inbox_take(kvw_inbox_t* inbox, char** errptr);
/* Waits up to timeout_ms (0 .. 24 h) for an event, then takes all (empty on timeout). */
kvw_inbox_events_t* kvw_inbox_wait(kvw_inbox_t* inbox, int64_t timeout_ms, char** errptr);
void kvw_inbox_destroy(kvw_inbox_t* inbox);
size_t kvw_inbox_events_count(const kvw_inbox_events_t* events);
/* KVW_INBOX_MESSAGE or KVW_INBOX_PEER_CLOSED; -1 for an out-of-range index. */
int kvw_inbox_events_kind(const kvw_inbox_events_t* events, size_t index);
uint64_t kvw_inbox_events_peer(const kvw_inbox_events_t* events, size_t index);
const char* kvw_inbox_events_peer_name(const kvw_inbox_events_t* events, size_t index);
const char* kvw_inbox_events_payload(const kvw_inbox_events_t* events, size_t index,
                                     size_t* length);
void kvw_inbox_events_destroy(kvw_inbox_events_t* events);

/* Stats() as JSON / Prometheus text; kvw_free it. NULL for a NULL engine. */
char* kvw_engine_stats_json(const kvw_engine_t* engine);
char* kvw_engine_stats_prometheus(const kvw_engine_t* engine);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVWIRE_KVWIRE_H_ */
