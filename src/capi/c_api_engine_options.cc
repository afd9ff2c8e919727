// The C API's engine options (include/kvwire/kvwire.h, kvw_engine_options_*): setters that
// store what the caller passes (refusing only a NULL or a value the field's type cannot hold),
// and the helpers the C API shares. No range is checked here: kvw_engine_create and
// kvw_connector_create forward to Engine::Create, whose one validator names the option and its
// range (kvwire/options_check.h).
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "kvwire/engine.h"
#include "kvwire/kvwire.h"
#include "src/capi/c_api_internal.h"
#include "src/util/option_range.h"

namespace kvwire::capi {

absl::Status SetSecret(const char* call, const char* secret, size_t length, std::string* out) {
  if (absl::Status s = RequireArray(call, "secret", secret, length); !s.ok()) return s;
  constexpr size_t kMaxSecretBytes = 64 * 1024;
  if (length > kMaxSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": a ", length, "-byte secret is over the ", kMaxSecretBytes, "-byte limit"));
  }
  out->assign(length == 0 ? "" : secret, length);
  return absl::OkStatus();
}

}  // namespace kvwire::capi

namespace {

using kvwire::capi::Guard;
using kvwire::capi::NoThrow;
using kvwire::capi::Require;

// Runs `store` (returning absl::Status) on the options behind a non-NULL handle.
template <typename Store>
int SetEngineOption(const char* call, kvw_engine_options_t* o, char** errptr, Store&& store) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require(call, {{"options", o}}); !s.ok()) return s;
    return store(o->rep);
  });
}

}  // namespace

extern "C" {

// --- engine options ---

kvw_engine_options_t* kvw_engine_options_create(void) {
  return NoThrow<kvw_engine_options_t*>(nullptr, [] { return new kvw_engine_options_t(); });
}
int kvw_engine_options_from_environment(kvw_engine_options_t* o, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_engine_options_from_environment", {{"options", o}});
        !s.ok()) {
      return s;
    }
    absl::StatusOr<kvwire::EngineOptions> from_env = kvwire::EngineOptions::FromEnvironment(o->rep);
    if (!from_env.ok()) return from_env.status();
    o->rep = *std::move(from_env);
    return absl::OkStatus();
  });
}
void kvw_engine_options_destroy(kvw_engine_options_t* o) { delete o; }

int kvw_engine_options_set_name(kvw_engine_options_t* o, const char* name, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_engine_options_set_name", {{"options", o}, {"name", name}});
        !s.ok()) {
      return s;
    }
    o->rep.name = name;
    return absl::OkStatus();
  });
}
int kvw_engine_options_set_listen_address(kvw_engine_options_t* o, const char* address,
                                          char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_engine_options_set_listen_address",
                                 {{"options", o}, {"address", address}});
        !s.ok()) {
      return s;
    }
    o->rep.listen_address = address;
    return absl::OkStatus();
  });
}
int kvw_engine_options_set_transport(kvw_engine_options_t* o, const char* transport,
                                     char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_options_set_transport";
    if (absl::Status s = Require(kCall, {{"options", o}, {"transport", transport}}); !s.ok()) {
      return s;
    }
    // Any name: Engine::Create checks it (the one validator).
    o->rep.transport = transport;
    return absl::OkStatus();
  });
}
int kvw_engine_options_set_secret(kvw_engine_options_t* o, const char* secret, size_t length,
                                  char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    constexpr char kCall[] = "kvw_engine_options_set_secret";
    if (absl::Status s = Require(kCall, {{"options", o}}); !s.ok()) return s;
    return kvwire::capi::SetSecret(kCall, secret, length, &o->rep.shared_secret);
  });
}
int kvw_engine_options_set_transport_option(kvw_engine_options_t* o, const char* transport,
                                            const char* key, const char* value, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s =
            Require("kvw_engine_options_set_transport_option",
                    {{"options", o}, {"transport", transport}, {"key", key}, {"value", value}});
        !s.ok()) {
      return s;
    }
    // The transport's own setter: it parses; its Validate (through Engine::Create) checks.
    return o->rep.transports.Set(transport, key, value);
  });
}

// Numeric options: one line each. Only the field's type is checked here; every range is
// Engine::Create's (src/core/options_check.cc), reported by kvw_engine_create.
#define KVW_ENGINE_INT(field)                                                                \
  int kvw_engine_options_set_##field(kvw_engine_options_t* o, int64_t v, char** errptr) {    \
    return SetEngineOption(                                                                  \
        "kvw_engine_options_set_" #field, o, errptr,                                         \
        [v](kvwire::EngineOptions& r) { return kvwire::StoreOption(#field, v, &r.field); }); \
  }
#define KVW_ENGINE_MS(field)                                                              \
  int kvw_engine_options_set_##field(kvw_engine_options_t* o, int64_t v, char** errptr) { \
    return SetEngineOption("kvw_engine_options_set_" #field, o, errptr,                   \
                           [v](kvwire::EngineOptions& r) {                                \
                             r.field = absl::Milliseconds(v);                             \
                             return absl::OkStatus();                                     \
                           });                                                            \
  }

KVW_ENGINE_INT(max_op_bytes)
KVW_ENGINE_INT(stripe_min_bytes)
KVW_ENGINE_INT(max_frame_bytes)
KVW_ENGINE_MS(heartbeat_interval)
KVW_ENGINE_MS(peer_lease)
KVW_ENGINE_MS(connect_timeout)
KVW_ENGINE_MS(transfer_timeout)
KVW_ENGINE_INT(io_threads)
KVW_ENGINE_INT(max_message_bytes)
KVW_ENGINE_INT(verify_checksums)
KVW_ENGINE_INT(max_pending_handshakes)
KVW_ENGINE_INT(max_pending_handshakes_per_source)
KVW_ENGINE_INT(max_control_connections)
KVW_ENGINE_INT(max_control_send_queue_bytes)
KVW_ENGINE_INT(max_undrained_notifications)
KVW_ENGINE_INT(closed_peers_kept)

#undef KVW_ENGINE_INT
#undef KVW_ENGINE_MS

int kvw_engine_options_set_compat_salt(kvw_engine_options_t* o, uint64_t v, char** errptr) {
  return Guard(errptr, [&]() -> absl::Status {
    if (absl::Status s = Require("kvw_engine_options_set_compat_salt", {{"options", o}}); !s.ok()) {
      return s;
    }
    o->rep.compat_salt = v;
    return absl::OkStatus();
  });
}

}  // extern "C"
