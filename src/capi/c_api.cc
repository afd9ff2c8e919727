// The C API (include/kvwire/kvwire.h) over kvwire::Connector and kvwire::Layout. Nothing
// throws across it: every entry point catches and reports through errptr.
#include <memory>
#include <string>
#include <vector>

#include "kvwire/connector.h"
#include "kvwire/kvwire.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"
#include "src/capi/c_api_internal.h"

namespace {

using kvwire::capi::CopyString;
using kvwire::capi::Guard;
using kvwire::capi::GuardMake;
using kvwire::capi::NoThrow;
using kvwire::capi::Require;
using kvwire::capi::RequireArray;
using kvwire::capi::Str;

// A string option of the connector: `field` gets `value` ("" for NULL).
template <typename Setter>
int SetString(const char* call, kvw_options_t* o, const char* value, char** errptr, Setter&& set) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require(call, {{"options", o}}); !s.ok()) return s;
    set(Str(value));
    return absl::OkStatus();
  });
}

// A millisecond option of the connector; its range is Connector::Create's
// (ValidateConnectorOptions), so kvw_connector_create reports a value out of it.
int SetMs(const char* call, kvw_options_t* o, int64_t ms, absl::Duration* field, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require(call, {{"options", o}}); !s.ok()) return s;
    *field = absl::Milliseconds(ms);
    return absl::OkStatus();
  });
}

const kvwire::BlockTable& Blocks(const kvw_block_table_t* t) {
  static const kvwire::BlockTable* const kEmpty = new kvwire::BlockTable();
  return t == nullptr ? *kEmpty : t->rep;
}

}  // namespace

extern "C" {

const char* kvw_version(void) { return "kvwire 0.1.0"; }
void kvw_free(void* ptr) { std::free(ptr); }

kvw_buffer_t* kvw_buffer_create(size_t length, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_buffer_t>> {
    absl::StatusOr<kvwire::ShareableBuffer> b = kvwire::ShareableBuffer::Create(length, "kvw-c");
    if (!b.ok()) return b.status();
    return std::make_unique<kvw_buffer_t>(kvw_buffer_t{std::move(*b)});
  });
}
void* kvw_buffer_data(const kvw_buffer_t* b) { return b == nullptr ? nullptr : b->rep.data(); }
size_t kvw_buffer_size(const kvw_buffer_t* b) { return b == nullptr ? 0 : b->rep.size(); }
void kvw_buffer_destroy(kvw_buffer_t* b) { delete b; }

kvw_layout_t* kvw_layout_preset(const char* name, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_layout_t>> {
    if (absl::Status s = Require("kvw_layout_preset", {{"name", name}}); !s.ok()) return s;
    absl::StatusOr<kvwire::Layout> l = kvwire::PresetLayout(name);
    if (!l.ok()) return l.status();
    return std::make_unique<kvw_layout_t>(kvw_layout_t{std::move(*l)});
  });
}
kvw_layout_t* kvw_layout_from_json(const char* json, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_layout_t>> {
    if (absl::Status s = Require("kvw_layout_from_json", {{"json", json}}); !s.ok()) return s;
    absl::StatusOr<kvwire::Layout> l = kvwire::LayoutFromJson(json);
    if (!l.ok()) return l.status();
    return std::make_unique<kvw_layout_t>(kvw_layout_t{std::move(*l)});
  });
}
char* kvw_layout_to_json(const kvw_layout_t* l) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    return l == nullptr ? nullptr : CopyString(kvwire::LayoutToJson(l->rep));
  });
}
uint64_t kvw_layout_assign_backing(kvw_layout_t* l, uint64_t base, uint64_t num_blocks,
                                   uint64_t state_blocks) {
  if (l == nullptr) return 0;
  return NoThrow<uint64_t>(
      0, [&] { return kvwire::AssignBacking(&l->rep, base, num_blocks, state_blocks); });
}
size_t kvw_layout_num_groups(const kvw_layout_t* l) {
  return l == nullptr ? 0 : l->rep.groups.size();
}
const char* kvw_layout_group_name(const kvw_layout_t* l, size_t g) {
  return l != nullptr && g < l->rep.groups.size() ? l->rep.groups[g].name.c_str() : nullptr;
}
uint64_t kvw_layout_group_page_bytes(const kvw_layout_t* l, size_t g) {
  return l != nullptr && g < l->rep.groups.size() ? l->rep.groups[g].page_bytes : 0;
}
int kvw_layout_group_tokens_per_block(const kvw_layout_t* l, size_t g) {
  return l != nullptr && g < l->rep.groups.size() ? l->rep.groups[g].tokens_per_block : 0;
}
int kvw_layout_group_is_state(const kvw_layout_t* l, size_t g) {
  return l != nullptr && g < l->rep.groups.size() && l->rep.groups[g].per_request_state ? 1 : 0;
}
size_t kvw_layout_group_num_layers(const kvw_layout_t* l, size_t g) {
  return l != nullptr && g < l->rep.groups.size() ? l->rep.groups[g].layers.size() : 0;
}
uint64_t kvw_layout_block_address(const kvw_layout_t* l, size_t g, size_t layer, uint64_t block) {
  if (l == nullptr || g >= l->rep.groups.size()) return 0;
  const kvwire::CacheGroup& group = l->rep.groups[g];
  if (layer >= group.layer_base.size()) return 0;
  return group.BlockAddress(layer, block, 0);
}
int kvw_layout_check_compatible(const kvw_layout_t* p, const kvw_layout_t* d, char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s = Require("kvw_layout_check_compatible", {{"prefill", p}, {"decode", d}});
        !s.ok()) {
      return s;
    }
    return kvwire::CheckCompatible(p->rep, d->rep);
  });
}
void kvw_layout_destroy(kvw_layout_t* l) { delete l; }

kvw_block_table_t* kvw_block_table_create(void) {
  return NoThrow<kvw_block_table_t*>(nullptr, [] { return new kvw_block_table_t; });
}
void kvw_block_table_set(kvw_block_table_t* t, const char* group, const int64_t* ids,
                         size_t count) {
  // No errptr to report through: a NULL table, or NULL ids with a count, changes nothing.
  if (t == nullptr || (ids == nullptr && count > 0)) return;
  try {
    t->rep[Str(group)].assign(ids, ids + count);
  } catch (...) {
    // Out of memory: the table keeps what it had.
  }
}
void kvw_block_table_destroy(kvw_block_table_t* t) { delete t; }

kvw_options_t* kvw_options_create(void) {
  return NoThrow<kvw_options_t*>(nullptr, [] { return new kvw_options_t(); });
}
int kvw_options_from_environment(kvw_options_t* o, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_options_from_environment", {{"options", o}}); !s.ok()) {
      return s;
    }
    absl::StatusOr<kvwire::ConnectorOptions> from_env =
        kvwire::ConnectorOptions::FromEnvironment(o->rep);
    if (!from_env.ok()) return from_env.status();
    o->rep = *std::move(from_env);
    return absl::OkStatus();
  });
}
void kvw_options_set_role(kvw_options_t* o, const char* role) {
  if (o != nullptr) o->rep.role = Str(role);
}
void kvw_options_set_mode(kvw_options_t* o, int mode) {
  if (o == nullptr) return;
  // KVW_MODE_* are KvMode's values; another is kvw_connector_create's error ("mode: ...").
  o->rep.mode = static_cast<kvwire::KvMode>(static_cast<uint32_t>(mode));
}
void kvw_options_set_name(kvw_options_t* o, const char* name) {
  if (o != nullptr) o->rep.engine.name = Str(name);
}
void kvw_options_set_listen_address(kvw_options_t* o, const char* address) {
  if (o != nullptr) o->rep.engine.listen_address = Str(address);
}
int kvw_options_set_transport(kvw_options_t* o, const char* transport, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s =
            Require("kvw_options_set_transport", {{"options", o}, {"transport", transport}});
        !s.ok()) {
      return s;
    }
    // Any name: Engine::Create checks it (the one validator).
    o->rep.engine.transport = transport;
    return absl::OkStatus();
  });
}
void kvw_options_set_request_timeout_ms(kvw_options_t* o, int64_t ms) {
  if (o != nullptr) o->rep.request_timeout = absl::Milliseconds(ms);
}
int kvw_options_set_secret(kvw_options_t* o, const char* secret, size_t length, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_options_set_secret", {{"options", o}}); !s.ok()) return s;
    return kvwire::capi::SetSecret("kvw_options_set_secret", secret, length,
                                   &o->rep.engine.shared_secret);
  });
}
int kvw_options_set_engine_options(kvw_options_t* o, const kvw_engine_options_t* engine,
                                   char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s =
            Require("kvw_options_set_engine_options", {{"options", o}, {"engine", engine}});
        !s.ok()) {
      return s;
    }
    o->rep.engine = engine->rep;
    return absl::OkStatus();
  });
}
int kvw_options_set_transport_option(kvw_options_t* o, const char* transport, const char* key,
                                     const char* value, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s =
            Require("kvw_options_set_transport_option",
                    {{"options", o}, {"transport", transport}, {"key", key}, {"value", value}});
        !s.ok()) {
      return s;
    }
    return o->rep.engine.transports.Set(transport, key, value);
  });
}
int kvw_options_set_request_timeout(kvw_options_t* o, int64_t ms, char** errptr) {
  return SetMs("kvw_options_set_request_timeout", o, ms,
               o == nullptr ? nullptr : &o->rep.request_timeout, errptr);
}
int kvw_options_set_handshake_timeout(kvw_options_t* o, int64_t ms, char** errptr) {
  return SetMs("kvw_options_set_handshake_timeout", o, ms,
               o == nullptr ? nullptr : &o->rep.handshake_timeout, errptr);
}
int kvw_options_set_read_grants(kvw_options_t* o, int on, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_options_set_read_grants", {{"options", o}}); !s.ok()) {
      return s;
    }
    if (on != 0 && on != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("kvw_options_set_read_grants: on is ", on, ", expected 0 or 1"));
    }
    o->rep.read_grants = on == 1;
    return absl::OkStatus();
  });
}
int kvw_options_set_metrics_address(kvw_options_t* o, const char* address, char** errptr) {
  return SetString("kvw_options_set_metrics_address", o, address, errptr,
                   [&](std::string v) { o->rep.metrics_address = std::move(v); });
}
int kvw_options_set_etcd_endpoints(kvw_options_t* o, const char* endpoints, char** errptr) {
  return SetString("kvw_options_set_etcd_endpoints", o, endpoints, errptr,
                   [&](std::string v) { o->rep.etcd_endpoints = std::move(v); });
}
int kvw_options_set_cluster(kvw_options_t* o, const char* cluster, char** errptr) {
  return SetString("kvw_options_set_cluster", o, cluster, errptr,
                   [&](std::string v) { o->rep.cluster = std::move(v); });
}
int kvw_options_set_etcd_call_timeout(kvw_options_t* o, int64_t ms, char** errptr) {
  return SetMs("kvw_options_set_etcd_call_timeout", o, ms,
               o == nullptr ? nullptr : &o->rep.etcd_call_timeout, errptr);
}
int kvw_options_set_etcd_lease_seconds(kvw_options_t* o, int64_t seconds, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_options_set_etcd_lease_seconds";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    o->rep.etcd_lease_seconds = seconds;
    return absl::OkStatus();
  });
}
int kvw_options_set_etcd_auth(kvw_options_t* o, const char* user, const char* password,
                              char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_options_set_etcd_auth";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    // Half a pair is kvw_connector_create's error (ValidateConnectorOptions).
    o->rep.etcd_user = Str(user);
    o->rep.etcd_password = Str(password);
    return absl::OkStatus();
  });
}
int kvw_options_set_etcd_tls(kvw_options_t* o, const char* ca_file, const char* cert_file,
                             const char* key_file, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_options_set_etcd_tls";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    o->rep.etcd_ca_file = Str(ca_file);
    o->rep.etcd_cert_file = Str(cert_file);
    o->rep.etcd_key_file = Str(key_file);
    return absl::OkStatus();
  });
}
void kvw_options_destroy(kvw_options_t* o) { delete o; }

kvw_connector_t* kvw_connector_create(const kvw_options_t* o, char** errptr) {
  return GuardMake(errptr, [&]() -> absl::StatusOr<std::unique_ptr<kvw_connector_t>> {
    kvwire::ConnectorOptions options = o == nullptr ? kvwire::ConnectorOptions() : o->rep;
    absl::StatusOr<std::unique_ptr<kvwire::Connector>> c =
        kvwire::Connector::Create(std::move(options));
    if (!c.ok()) return c.status();
    auto handle = std::make_unique<kvw_connector_t>();
    handle->rep = std::move(*c);
    handle->engine.rep = &handle->rep->engine();
    return handle;
  });
}
void kvw_connector_destroy(kvw_connector_t* c) { delete c; }
const char* kvw_connector_engine_id(const kvw_connector_t* c) {
  return c == nullptr ? nullptr : c->rep->engine_id().c_str();
}
char* kvw_connector_address(kvw_connector_t* c) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    return c == nullptr ? nullptr : CopyString(c->rep->engine().address());
  });
}
char* kvw_connector_metrics_address(const kvw_connector_t* c) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    return c == nullptr ? nullptr : CopyString(c->rep->metrics_address());
  });
}
kvw_engine_t* kvw_connector_engine(kvw_connector_t* c) {
  return c == nullptr ? nullptr : &c->engine;
}
int kvw_connector_announce(kvw_connector_t* c, const char* http_address, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_connector_announce", {{"connector", c}}); !s.ok()) {
      return s;
    }
    return c->rep->Announce(Str(http_address));
  });
}
int kvw_connector_announced(const kvw_connector_t* c) {
  return NoThrow(0, [&] { return c != nullptr && c->rep->Announced() ? 1 : 0; });
}

int kvw_register_kv_caches(kvw_connector_t* c, const kvw_layout_t* l, void* const* ptrs,
                           const size_t* lengths, size_t count, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_register_kv_caches";
    absl::Status s = Require(kCall, {{"connector", c}, {"layout", l}});
    if (s.ok()) s = RequireArray(kCall, "ptrs", ptrs, count);
    if (s.ok()) s = RequireArray(kCall, "lengths", lengths, count);
    if (!s.ok()) return s;
    std::vector<kvwire::KvMemory> memory;
    for (size_t i = 0; i < count; ++i) memory.push_back({ptrs[i], lengths[i]});
    return c->rep->RegisterKvCaches(l->rep, memory);
  });
}

int kvw_register_kv_memory(kvw_connector_t* c, const kvw_layout_t* l, void* const* ptrs,
                           const size_t* lengths, const int* kinds, const int* gpu_devices,
                           size_t count, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_register_kv_memory";
    absl::Status s = Require(kCall, {{"connector", c}, {"layout", l}});
    if (s.ok()) s = RequireArray(kCall, "ptrs", ptrs, count);
    if (s.ok()) s = RequireArray(kCall, "lengths", lengths, count);
    if (!s.ok()) return s;
    std::vector<kvwire::KvMemory> memory;
    for (size_t i = 0; i < count; ++i) {
      kvwire::KvMemory m{ptrs[i], lengths[i]};
      const int kind = kinds == nullptr ? KVW_MEMORY_HOST : kinds[i];
      if (kind != KVW_MEMORY_HOST && kind != KVW_MEMORY_GPU) {
        return absl::InvalidArgumentError("kvw_register_kv_memory: unknown memory kind " +
                                          std::to_string(kind) + " of range " + std::to_string(i));
      }
      m.kind = kind == KVW_MEMORY_GPU ? kvwire::MemoryKind::kGpu : kvwire::MemoryKind::kHost;
      m.gpu_device = gpu_devices == nullptr ? -1 : gpu_devices[i];
      memory.push_back(m);
    }
    return c->rep->RegisterKvCaches(l->rep, memory);
  });
}

int kvw_get_num_new_matched_tokens(kvw_connector_t* c, const char* request_id, uint64_t num_tokens,
                                   uint64_t num_computed_tokens, const char* params,
                                   uint64_t* num_external_tokens, int* load_async, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_get_num_new_matched_tokens",
                                 {{"connector", c}, {"request_id", request_id}});
        !s.ok()) {
      return s;
    }
    absl::StatusOr<kvwire::MatchResult> m =
        c->rep->GetNumNewMatchedTokens(request_id, num_tokens, num_computed_tokens, Str(params));
    if (!m.ok()) return m.status();
    if (num_external_tokens != nullptr) *num_external_tokens = m->num_external_tokens;
    if (load_async != nullptr) *load_async = m->load_async ? 1 : 0;
    return absl::OkStatus();
  });
}

int kvw_update_state_after_alloc(kvw_connector_t* c, const char* request_id,
                                 const kvw_block_table_t* blocks, uint64_t num_external_tokens,
                                 char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s =
            Require("kvw_update_state_after_alloc", {{"connector", c}, {"request_id", request_id}});
        !s.ok()) {
      return s;
    }
    return c->rep->UpdateStateAfterAlloc(request_id, Blocks(blocks), num_external_tokens);
  });
}

char* kvw_build_connector_meta(kvw_connector_t* c) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    return c == nullptr ? nullptr : CopyString(c->rep->BuildConnectorMeta());
  });
}

int kvw_request_finished(kvw_connector_t* c, const char* request_id,
                         const kvw_block_table_t* blocks, uint64_t num_tokens, const char* params,
                         int aborted, int* delay_free, char** params_out, char** errptr) {
  return kvw_request_finished_with_transfer_id(c, request_id, blocks, num_tokens, params, aborted,
                                               nullptr, delay_free, params_out, errptr);
}
int kvw_request_finished_with_transfer_id(kvw_connector_t* c, const char* request_id,
                                          const kvw_block_table_t* blocks, uint64_t num_tokens,
                                          const char* params, int aborted, const char* transfer_id,
                                          int* delay_free, char** params_out, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s =
            Require("kvw_request_finished", {{"connector", c}, {"request_id", request_id}});
        !s.ok()) {
      return s;
    }
    absl::StatusOr<kvwire::RequestFinishedResult> r = c->rep->RequestFinished(
        request_id, Blocks(blocks), num_tokens, Str(params), aborted != 0, Str(transfer_id));
    if (!r.ok()) return r.status();
    if (delay_free != nullptr) *delay_free = r->delay_free ? 1 : 0;
    if (params_out != nullptr) *params_out = CopyString(r->kv_transfer_params);
    return absl::OkStatus();
  });
}

int kvw_bind_connector_meta(kvw_connector_t* c, const char* meta, char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s = Require("kvw_bind_connector_meta", {{"connector", c}, {"meta", meta}});
        !s.ok()) {
      return s;
    }
    return c->rep->BindConnectorMeta(meta);
  });
}
int kvw_start_load_kv(kvw_connector_t* c, char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s = Require("kvw_start_load_kv", {{"connector", c}}); !s.ok()) return s;
    return c->rep->StartLoadKv();
  });
}
int kvw_wait_for_layer_load(kvw_connector_t* c, int layer, char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s = Require("kvw_wait_for_layer_load", {{"connector", c}}); !s.ok()) {
      return s;
    }
    return c->rep->WaitForLayerLoad(layer);
  });
}
int kvw_save_kv_layer(kvw_connector_t* c, int layer, char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s = Require("kvw_save_kv_layer", {{"connector", c}}); !s.ok()) return s;
    return c->rep->SaveKvLayer(layer);
  });
}
int kvw_save_kv_layer_event(kvw_connector_t* c, int layer, void* event, int device, char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s = Require("kvw_save_kv_layer_event", {{"connector", c}}); !s.ok()) {
      return s;
    }
    return event == nullptr ? c->rep->SaveKvLayer(layer)
                            : c->rep->SaveKvLayer(layer, kvwire::GpuEvent{event, device});
  });
}
int kvw_wait_for_save(kvw_connector_t* c, char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s = Require("kvw_wait_for_save", {{"connector", c}}); !s.ok()) return s;
    return c->rep->WaitForSave();
  });
}

kvw_finished_t* kvw_get_finished(kvw_connector_t* c) {
  return NoThrow<kvw_finished_t*>(nullptr, [&]() -> kvw_finished_t* {
    return c == nullptr ? nullptr : new kvw_finished_t{c->rep->GetFinished()};
  });
}
size_t kvw_finished_count(const kvw_finished_t* f, int kind) {
  if (f == nullptr) return 0;
  switch (kind) {
    case KVW_FINISHED_SENDING:
      return f->rep.finished_sending.size();
    case KVW_FINISHED_RECVING:
      return f->rep.finished_recving.size();
    case KVW_FAILED_LOADS:
      return f->rep.failed_loads.size();
  }
  return 0;
}
const char* kvw_finished_request(const kvw_finished_t* f, int kind, size_t i) {
  if (i >= kvw_finished_count(f, kind)) return nullptr;
  switch (kind) {
    case KVW_FINISHED_SENDING:
      return f->rep.finished_sending[i].c_str();
    case KVW_FINISHED_RECVING:
      return f->rep.finished_recving[i].c_str();
    default:
      return f->rep.failed_loads[i].request_id.c_str();
  }
}
const char* kvw_finished_reason(const kvw_finished_t* f, size_t i) {
  return f != nullptr && i < f->rep.failed_loads.size() ? f->rep.failed_loads[i].reason.c_str()
                                                        : nullptr;
}
void kvw_finished_destroy(kvw_finished_t* f) { delete f; }

int kvw_abort(kvw_connector_t* c, const char* request_id, char** errptr) {
  return Guard(errptr, [&] {
    if (absl::Status s = Require("kvw_abort", {{"connector", c}, {"request_id", request_id}});
        !s.ok()) {
      return s;
    }
    return c->rep->Abort(request_id);
  });
}
size_t kvw_live_requests(const kvw_connector_t* c) {
  return c == nullptr ? 0 : c->rep->LiveRequests();
}
char* kvw_stats_json(const kvw_connector_t* c) {
  return NoThrow<char*>(
      nullptr, [&]() -> char* { return c == nullptr ? nullptr : CopyString(c->rep->StatsJson()); });
}
char* kvw_stats_prometheus(const kvw_connector_t* c) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    return c == nullptr ? nullptr : CopyString(c->rep->StatsPrometheus());
  });
}

char* kvw_write_mode_params(const char* host, int port, const char* transfer_id,
                            uint64_t num_tokens) {
  return NoThrow<char*>(nullptr, [&]() -> char* {
    kvwire::KvTransferParams p;
    p.host = Str(host);
    p.port = port;
    p.transfer_id = Str(transfer_id);
    p.mode = kvwire::KvMode::kWrite;
    p.num_tokens = num_tokens;
    p.do_remote_prefill = true;
    return CopyString(p.ToJson());
  });
}

}  // extern "C"
