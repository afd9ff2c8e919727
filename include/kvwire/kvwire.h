/* kvwire C API: the KV connector (and the layouts it needs) for C programs and dlopen-style
 * plugins. It mirrors kvwire/connector.h and kvwire/layout.h call for call.
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
 *    without errptr need valid pointers, as in LevelDB.
 *  - Block tables are passed as kvw_block_table_t (group name -> block ids, -1 = none).
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
/* Starts from the KVWIRE_* environment (KVWIRE_SECRET, KVWIRE_LISTEN, ...; see
 * EngineOptions::FromEnvironment); the setters below override it. */
kvw_options_t* kvw_options_create(void);
void kvw_options_set_role(kvw_options_t* options, const char* role);
void kvw_options_set_mode(kvw_options_t* options, int mode);
void kvw_options_set_name(kvw_options_t* options, const char* name);
void kvw_options_set_listen_address(kvw_options_t* options, const char* address);
/* "auto", "tcp", "shm" or "rdma"; returns non-zero for an unknown name. */
int kvw_options_set_transport(kvw_options_t* options, const char* transport, char** errptr);
void kvw_options_set_request_timeout_ms(kvw_options_t* options, int64_t ms);
/* The deployment's shared secret: `length` bytes (any bytes; length 0 clears it, and then no
 * peer is asked to prove anything). With a secret, peers prove they know it (HMAC-SHA256
 * challenge-response both ways) before any KV moves, and a peer without it is refused.
 * Overrides KVWIRE_SECRET. Returns non-zero when options, or secret with length > 0, is NULL. */
int kvw_options_set_secret(kvw_options_t* options, const char* secret, size_t length,
                           char** errptr);
void kvw_options_destroy(kvw_options_t* options);

/* --- connector --- */
/* options NULL: the defaults and the KVWIRE_* environment, as kvw_options_create. */
kvw_connector_t* kvw_connector_create(const kvw_options_t* options, char** errptr);
void kvw_connector_destroy(kvw_connector_t* connector);
const char* kvw_connector_engine_id(const kvw_connector_t* connector);
char* kvw_connector_address(kvw_connector_t* connector);

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

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVWIRE_KVWIRE_H_ */
