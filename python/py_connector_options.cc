// Python binding of kvwire::ConnectorOptions.
#include "python/py_support.h"
#include "src/util/option_range.h"

namespace kvwire_py {
namespace {

using Options = kvwire::ConnectorOptions;

// A duration as float seconds (*_s). Only what the field cannot hold is refused here (NaN);
// every range is Connector::Create's (ValidateConnectorOptions), as for C++ and C.
void DurationField(py::class_<Options>& c, const char* name, absl::Duration Options::*field) {
  c.def_property(
      name, [field](const Options& o) { return Seconds(o.*field); },
      [name, field](Options& o, double s) {
        if (s != s) throw py::value_error(absl::StrCat(name, ": not a number"));
        o.*field = absl::Seconds(s);
      });
}

}  // namespace

void BindConnectorOptions(py::module_& m) {
  py::class_<Options> co(m, "ConnectorOptions",
                         "kvwire::ConnectorOptions: the C++ defaults (the environment is not "
                         "read; see from_environment). Connector(options=...) checks them.");
  co.def(py::init<>())
      .def_static(
          "from_environment",
          [](const std::optional<Options>& base) {
            return Take(Options::FromEnvironment(base.value_or(Options())));
          },
          py::arg("base") = py::none(),
          "ConnectorOptions::FromEnvironment, the one reader of the KVWIRE_* environment: "
          "EngineOptions.from_environment's variables for .engine, then KVWIRE_ETCD_USER, "
          "KVWIRE_ETCD_PASSWORD (or KVWIRE_ETCD_PASSWORD_FILE), KVWIRE_ETCD_CACERT, "
          "KVWIRE_ETCD_CERT and KVWIRE_ETCD_KEY; each that is set and non-empty replaces "
          "base's value; a bad value raises ValueError naming the variable")
      .def_readwrite("engine", &Options::engine, "the engine's options (kvwire.EngineOptions)")
      .def_readwrite("role", &Options::role)
      .def_property(
          "mode", [](const Options& o) { return std::string(kvwire::KvModeName(o.mode)); },
          [](Options& o, const std::string& mode) { o.mode = Take(kvwire::ParseKvMode(mode)); })
      .def_readwrite("metrics_address", &Options::metrics_address)
      .def_readwrite("etcd_endpoints", &Options::etcd_endpoints)
      .def_readwrite("cluster", &Options::cluster)
      .def_property(
          "etcd_lease_seconds", [](const Options& o) { return o.etcd_lease_seconds; },
          [](Options& o, int64_t v) { o.etcd_lease_seconds = v; })
      .def_readwrite("etcd_user", &Options::etcd_user)
      .def_readwrite("etcd_password", &Options::etcd_password)
      .def_readwrite("etcd_ca_file", &Options::etcd_ca_file)
      .def_readwrite("etcd_cert_file", &Options::etcd_cert_file)
      .def_readwrite("etcd_key_file", &Options::etcd_key_file)
      .def_readwrite("read_grants", &Options::read_grants)
      .def("__repr__", [](const Options& o) {
        return absl::StrCat("ConnectorOptions(role='", o.role, "', mode='",
                            kvwire::KvModeName(o.mode), "', engine='", o.engine.name, "')");
      });
  DurationField(co, "request_timeout_s", &Options::request_timeout);
  DurationField(co, "handshake_timeout_s", &Options::handshake_timeout);
  DurationField(co, "etcd_call_timeout_s", &Options::etcd_call_timeout);
}

}  // namespace kvwire_py
