// What the files of the _kvwire module share: status-to-exception conversion, the Buffer type,
// argument conversions, and one Bind* function per file (kvwire_py.cc calls them in order).
#ifndef KVWIRE_PYTHON_PY_SUPPORT_H_
#define KVWIRE_PYTHON_PY_SUPPORT_H_

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/memory.h"

namespace kvwire_py {

namespace py = pybind11;

[[noreturn]] inline void Throw(const absl::Status& s) {
  if (absl::IsInvalidArgument(s)) throw py::value_error(s.ToString());
  throw std::runtime_error(s.ToString());
}
inline void Check(const absl::Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Take(absl::StatusOr<T> v) {
  if (!v.ok()) Throw(v.status());
  return std::move(*v);
}

// Shareable host memory exposed through the buffer protocol.
struct Buffer {
  kvwire::ShareableBuffer rep;
};

// A Buffer (host memory) or a KvMemory (any range, e.g. a torch tensor's data_ptr()).
inline kvwire::KvMemory ToKvMemory(const py::handle& h) {
  if (py::isinstance<Buffer>(h)) {
    const Buffer& b = h.cast<const Buffer&>();
    return {b.rep.data(), b.rep.size()};
  }
  if (py::isinstance<kvwire::KvMemory>(h)) return h.cast<kvwire::KvMemory>();
  throw py::type_error("register_kv_caches: expected kvwire.Buffer or kvwire.KvMemory items");
}

// The engine options of a Python-made engine or connector given no options: the C++ defaults
// (the environment is read only by EngineOptions.from_environment, called by whoever wants
// it), then `secret` when given (str, UTF-8, or bytes; "" / b"" means none).
inline std::string SecretFrom(const py::object& secret) {
  if (!py::isinstance<py::bytes>(secret) && !py::isinstance<py::str>(secret)) {
    throw py::type_error("secret must be str, bytes or None");
  }
  return secret.cast<std::string>();
}
inline kvwire::EngineOptions EngineOptionsFor(const py::object& secret) {
  kvwire::EngineOptions o;
  if (!secret.is_none()) o.shared_secret = SecretFrom(secret);
  return o;
}

inline double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }
// A duration option in seconds: positive and finite (0 < s <= 1 day), else ValueError naming it.
inline absl::Duration FromSeconds(const char* name, double s) {
  if (!(s > 0 && s <= 86400)) {
    throw py::value_error(absl::StrCat(name, ": ", s, " s is out of range (0 < s <= 86400)"));
  }
  return absl::Seconds(s);
}
// A call's argument within [lo, hi], else ValueError naming it and the range (options are
// not: Engine::Create and Connector::Create check them).
template <typename T>
T InRange(const char* name, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    throw py::value_error(absl::StrCat(name, ": ", v, " is out of range (", lo, "..", hi, ")"));
  }
  return static_cast<T>(v);
}

// py_layout.cc: Buffer, KvMemory, CacheGroup, Layout, select_blocks, plan_transfer.
void BindLayouts(py::module_& m);
// py_engine_options.cc: kvwire.EngineOptions.
void BindEngineOptions(py::module_& m);
// py_engine.cc: kvwire.Inbox and kvwire.Engine.
void BindEngine(py::module_& m);
// py_connector_options.cc: kvwire.ConnectorOptions.
void BindConnectorOptions(py::module_& m);
// py_connector.cc: kvwire.Connector and parse_kv_transfer_params.
void BindConnector(py::module_& m);
// py_scheduler.cc: kvwire.SchedulerHalf (the scheduler half of vLLM's plugin).
void BindSchedulerHalf(py::module_& m);

}  // namespace kvwire_py

#endif  // KVWIRE_PYTHON_PY_SUPPORT_H_
