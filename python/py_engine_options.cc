// Python binding of kvwire::EngineOptions.
#include "absl/strings/str_join.h"

#include "python/py_support.h"
#include "src/util/option_range.h"

namespace kvwire_py {
namespace {

// Python's kvwire.EngineOptions: every field of kvwire::EngineOptions, durations as float
// seconds (*_s), the transport as its name; each transport's options by name
// (set_transport_option / transport_option: TransportOptions::Set/Get, whatever the transport,
// built-in or outside). An assignment refuses only what the field's type cannot hold (or text
// that does not parse); every range is Engine::Create's (kvwire/options_check.h), so Engine()
// and Connector() raise ValueError naming the option and its range, as C++ and C do.
template <typename T>
void IntField(py::class_<kvwire::EngineOptions>& c, const char* name,
              T kvwire::EngineOptions::*field) {
  c.def_property(
      name, [field](const kvwire::EngineOptions& o) { return o.*field; },
      [name, field](kvwire::EngineOptions& o, int64_t v) {
        Check(kvwire::StoreOption(name, v, &(o.*field)));
      });
}
void DurationField(py::class_<kvwire::EngineOptions>& c, const char* name,
                   absl::Duration kvwire::EngineOptions::*field) {
  c.def_property(
      name, [field](const kvwire::EngineOptions& o) { return Seconds(o.*field); },
      [name, field](kvwire::EngineOptions& o, double s) {
        if (s != s) throw py::value_error(absl::StrCat(name, ": not a number"));
        o.*field = absl::Seconds(s);
      });
}

}  // namespace

void BindEngineOptions(py::module_& m) {
  py::class_<kvwire::EngineOptions> eo(m, "EngineOptions",
                                       "kvwire::EngineOptions: the C++ defaults (the environment "
                                       "is not read; see from_environment)");
  eo.def(py::init<>())
      .def_static(
          "from_environment",
          [](const std::optional<kvwire::EngineOptions>& base) {
            return Take(
                kvwire::EngineOptions::FromEnvironment(base.value_or(kvwire::EngineOptions())));
          },
          py::arg("base") = py::none(),
          "EngineOptions::FromEnvironment: each KVWIRE_* variable that is set and non-empty "
          "replaces base's value; a bad value raises ValueError naming the variable")
      .def(
          "set_transport_option",
          [](kvwire::EngineOptions& o, const std::string& transport, const std::string& key,
             const py::object& value) {
            // Text as TransportOptions::Set takes it: bools 1/0, lists comma-joined, numbers
            // and duration strings ("20us") as written.
            std::string text;
            if (py::isinstance<py::bool_>(value)) {
              text = value.cast<bool>() ? "1" : "0";
            } else if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
              text = absl::StrJoin(value.cast<std::vector<std::string>>(), ",");
            } else {
              text = py::str(value).cast<std::string>();
            }
            Check(o.transports.Set(transport, key, text));
          },
          py::arg("transport"), py::arg("key"), py::arg("value"),
          "TransportOptions::Set of the transport named `transport` (e.g. ('tcp', 'io_poll', "
          "'50us')); the range is checked by Engine()/Connector()")
      .def(
          "transport_option",
          [](const kvwire::EngineOptions& o, const std::string& transport, const std::string& key) {
            const kvwire::TransportOptions* t = o.transports.Find(transport);
            if (t == nullptr) {
              throw py::value_error(absl::StrCat("unknown transport \"", transport, "\""));
            }
            std::string text;
            Check(t->Get(key, &text));
            return text;
          },
          py::arg("transport"), py::arg("key"),
          "The option's value as text (TransportOptions::Get)")
      .def(
          "transport_option_keys",
          [](const kvwire::EngineOptions& o, const std::string& transport) {
            const kvwire::TransportOptions* t = o.transports.Find(transport);
            if (t == nullptr) {
              throw py::value_error(absl::StrCat("unknown transport \"", transport, "\""));
            }
            return t->Keys();
          },
          py::arg("transport"))
      .def_property_readonly("transports",
                             [](const kvwire::EngineOptions& o) { return o.transports.Names(); })
      .def_readwrite("name", &kvwire::EngineOptions::name)
      .def_readwrite("listen_address", &kvwire::EngineOptions::listen_address)
      .def_property(
          "transport", [](const kvwire::EngineOptions& o) { return o.transport; },
          // Any name: Engine() checks it (an outside transport may carry it).
          [](kvwire::EngineOptions& o, const std::string& t) { o.transport = t; })
      .def_property(
          "shared_secret",
          [](const kvwire::EngineOptions& o) { return py::bytes(o.shared_secret); },
          [](kvwire::EngineOptions& o, const py::object& secret) {
            if (!py::isinstance<py::bytes>(secret) && !py::isinstance<py::str>(secret)) {
              throw py::type_error("shared_secret must be str or bytes");
            }
            o.shared_secret = secret.cast<std::string>();
          })
      .def_readwrite("compat_salt", &kvwire::EngineOptions::compat_salt)
      .def_readwrite("verify_checksums", &kvwire::EngineOptions::verify_checksums)
      .def("__repr__", [](const kvwire::EngineOptions& o) {
        return absl::StrCat("EngineOptions(name='", o.name, "', listen_address='", o.listen_address,
                            "', transport='", o.transport, "')");
      });
  IntField(eo, "max_op_bytes", &kvwire::EngineOptions::max_op_bytes);
  IntField(eo, "stripe_min_bytes", &kvwire::EngineOptions::stripe_min_bytes);
  IntField(eo, "max_frame_bytes", &kvwire::EngineOptions::max_frame_bytes);
  DurationField(eo, "heartbeat_interval_s", &kvwire::EngineOptions::heartbeat_interval);
  DurationField(eo, "peer_lease_s", &kvwire::EngineOptions::peer_lease);
  DurationField(eo, "connect_timeout_s", &kvwire::EngineOptions::connect_timeout);
  DurationField(eo, "transfer_timeout_s", &kvwire::EngineOptions::transfer_timeout);
  IntField(eo, "io_threads", &kvwire::EngineOptions::io_threads);
  IntField(eo, "max_message_bytes", &kvwire::EngineOptions::max_message_bytes);
  IntField(eo, "max_pending_handshakes", &kvwire::EngineOptions::max_pending_handshakes);
  IntField(eo, "max_pending_handshakes_per_source",
           &kvwire::EngineOptions::max_pending_handshakes_per_source);
  IntField(eo, "max_control_connections", &kvwire::EngineOptions::max_control_connections);
  IntField(eo, "max_control_send_queue_bytes",
           &kvwire::EngineOptions::max_control_send_queue_bytes);
  IntField(eo, "max_undrained_notifications", &kvwire::EngineOptions::max_undrained_notifications);
  IntField(eo, "closed_peers_kept", &kvwire::EngineOptions::closed_peers_kept);
}

}  // namespace kvwire_py
