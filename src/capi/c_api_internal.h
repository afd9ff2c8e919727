// What the C API's translation units (c_api.cc: connector and layouts; c_api_engine.cc: the
// engine; c_api_engine_options.cc: its options) share: the opaque types' definitions and the
// helpers that keep every entry point from throwing, dereferencing a caller's NULL, or storing an
// out-of-range value.
#ifndef KVWIRE_SRC_CAPI_C_API_INTERNAL_H_
#define KVWIRE_SRC_CAPI_C_API_INTERNAL_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/kvwire.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"

struct kvw_layout_t {
  kvwire::Layout rep;
};
struct kvw_options_t {
  kvwire::ConnectorOptions rep;
};
// An engine handle either owns its engine (kvw_engine_create) or borrows a connector's
// (kvw_connector_engine); destroying a borrowed one does nothing.
struct kvw_engine_t {
  std::unique_ptr<kvwire::Engine> owned;
  kvwire::Engine* rep = nullptr;
};
struct kvw_connector_t {
  std::unique_ptr<kvwire::Connector> rep;
  kvw_engine_t engine;  // borrowed view of rep->engine(), handed out by kvw_connector_engine
};
struct kvw_block_table_t {
  kvwire::BlockTable rep;
};
struct kvw_finished_t {
  kvwire::FinishedRequests rep;
};
struct kvw_buffer_t {
  kvwire::ShareableBuffer rep;
};
struct kvw_engine_options_t {
  kvwire::EngineOptions rep;
};

namespace kvwire::capi {

inline char* CopyString(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) return nullptr;
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return out;
}

inline void SetError(char** errptr, const std::string& message) {
  if (errptr == nullptr) return;
  std::free(*errptr);
  *errptr = CopyString(message);
}

// Reports a non-OK status; returns its code (0 when OK).
inline int Report(const absl::Status& s, char** errptr) {
  if (s.ok()) return 0;
  SetError(errptr, s.ToString());
  return static_cast<int>(s.code());
}

// The message of an exception caught at the C boundary; building it may itself throw (out of
// memory), and that must not leave the C ABI either: then *errptr stays as it was.
inline void SetInternalError(char** errptr, const char* what) noexcept {
  try {
    SetError(errptr, what == nullptr ? std::string("internal error")
                                     : std::string("internal error: ") + what);
  } catch (...) {
  }
}

// Runs `f` (returning absl::Status) so that no exception leaves the C ABI.
template <typename F>
int Guard(char** errptr, F&& f) {
  try {
    return Report(f(), errptr);
  } catch (const std::exception& e) {
    SetInternalError(errptr, e.what());
  } catch (...) {
    SetInternalError(errptr, nullptr);
  }
  return static_cast<int>(absl::StatusCode::kInternal);
}

// As Guard, for the calls that make an object: `f` returns absl::StatusOr<std::unique_ptr<T>>;
// NULL (with *errptr set) on failure.
template <typename F>
auto GuardMake(char** errptr, F&& f) -> typename decltype(f())::value_type::pointer {
  try {
    auto made = f();
    if (made.ok()) return made->release();
    Report(made.status(), errptr);
  } catch (const std::exception& e) {
    SetInternalError(errptr, e.what());
  } catch (...) {
    SetInternalError(errptr, nullptr);
  }
  return nullptr;
}

// For the calls without errptr that return a value: `fallback` instead of an exception.
template <typename T, typename F>
T NoThrow(T fallback, F&& f) {
  try {
    return f();
  } catch (...) {
    return fallback;
  }
}

// One pointer argument a call cannot do without.
struct Arg {
  const char* name;
  const void* ptr;
};

// A caller's NULL becomes an error naming the call and the argument instead of a crash.
inline absl::Status Require(const char* call, std::initializer_list<Arg> args) {
  for (const Arg& a : args) {
    if (a.ptr == nullptr) {
      return absl::InvalidArgumentError(std::string(call) + ": " + a.name + " is NULL");
    }
  }
  return absl::OkStatus();
}

// `count` entries of an array argument: NULL is fine only for an empty one.
inline absl::Status RequireArray(const char* call, const char* name, const void* ptr,
                                 size_t count) {
  if (ptr != nullptr || count == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(std::string(call) + ": " + name + " is NULL but count is " +
                                    std::to_string(count));
}

// The typed bound of every numeric setter: the value, or an error naming the setter, the value
// and the accepted range.
inline absl::Status RequireRange(const char* call, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(call, ": ", value, " is out of range (", lo, "..", hi, ")"));
}

// Stores a shared secret a C caller passes as (pointer, length): NULL only with length 0, at
// most 64 KiB (a length past that is a caller's mistake, not a secret).
absl::Status SetSecret(const char* call, const char* secret, size_t length, std::string* out);

inline std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

}  // namespace kvwire::capi

#endif  // KVWIRE_SRC_CAPI_C_API_INTERNAL_H_
