// Python binding of kvwire::EngineOptions.
#include "python/py_support.h"
#include "src/util/option_range.h"

namespace kvwire_py {
namespace {

// Python's kvwire.EngineOptions: every field of kvwire::EngineOptions, durations as float
// seconds (*_s), the transport as its name. An assignment refuses only what the field's type
// cannot hold; every range is Engine::Create's (src/core/options_check.h), so Engine() and
// Connector() raise ValueError naming the option and its range, as C++ and C do.
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
            return kvwire::EngineOptions::FromEnvironment(base.value_or(kvwire::EngineOptions()));
          },
          py::arg("base") = py::none(),
          "EngineOptions::FromEnvironment: each KVWIRE_* variable that is set, non-empty and "
          "valid replaces base's value; bad values are ignored (logged)")
      .def_readwrite("name", &kvwire::EngineOptions::name)
      .def_readwrite("listen_address", &kvwire::EngineOptions::listen_address)
      .def_property(
          "transport",
          [](const kvwire::EngineOptions& o) { return kvwire::TransportKindName(o.transport); },
          [](kvwire::EngineOptions& o, const std::string& t) {
            o.transport = Take(kvwire::ParseTransportKind(t));
          })
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
      .def_readwrite("rdma_devices", &kvwire::EngineOptions::rdma_devices)
      .def_readwrite("shm_cma", &kvwire::EngineOptions::shm_cma)
      .def_readwrite("shm_deny_ptrace", &kvwire::EngineOptions::shm_deny_ptrace)
      .def("__repr__", [](const kvwire::EngineOptions& o) {
        return absl::StrCat("EngineOptions(name='", o.name, "', listen_address='", o.listen_address,
                            "', transport='", kvwire::TransportKindName(o.transport), "')");
      });
  IntField(eo, "tcp_connections", &kvwire::EngineOptions::tcp_connections);
  IntField(eo, "max_op_bytes", &kvwire::EngineOptions::max_op_bytes);
  IntField(eo, "stripe_min_bytes", &kvwire::EngineOptions::stripe_min_bytes);
  IntField(eo, "max_frame_bytes", &kvwire::EngineOptions::max_frame_bytes);
  DurationField(eo, "heartbeat_interval_s", &kvwire::EngineOptions::heartbeat_interval);
  DurationField(eo, "peer_lease_s", &kvwire::EngineOptions::peer_lease);
  DurationField(eo, "connect_timeout_s", &kvwire::EngineOptions::connect_timeout);
  DurationField(eo, "transfer_timeout_s", &kvwire::EngineOptions::transfer_timeout);
  IntField(eo, "io_threads", &kvwire::EngineOptions::io_threads);
  IntField(eo, "max_message_bytes", &kvwire::EngineOptions::max_message_bytes);
  IntField(eo, "rdma_gid_index", &kvwire::EngineOptions::rdma_gid_index);
  IntField(eo, "rdma_qps_per_peer", &kvwire::EngineOptions::rdma_qps_per_peer);
  IntField(eo, "rdma_send_queue_depth", &kvwire::EngineOptions::rdma_send_queue_depth);
  IntField(eo, "rdma_qp_timeout", &kvwire::EngineOptions::rdma_qp_timeout);
  IntField(eo, "rdma_retry_count", &kvwire::EngineOptions::rdma_retry_count);
  IntField(eo, "rdma_rnr_retry", &kvwire::EngineOptions::rdma_rnr_retry);
  IntField(eo, "rdma_max_qps_per_device", &kvwire::EngineOptions::rdma_max_qps_per_device);
  IntField(eo, "tcp_max_data_connections", &kvwire::EngineOptions::tcp_max_data_connections);
  IntField(eo, "tcp_max_data_connections_per_peer",
           &kvwire::EngineOptions::tcp_max_data_connections_per_peer);
  IntField(eo, "tcp_max_pending_hellos", &kvwire::EngineOptions::tcp_max_pending_hellos);
  IntField(eo, "tcp_max_pending_hellos_per_address",
           &kvwire::EngineOptions::tcp_max_pending_hellos_per_address);
  DurationField(eo, "tcp_hello_timeout_s", &kvwire::EngineOptions::tcp_hello_timeout);
  DurationField(eo, "tcp_io_timeout_s", &kvwire::EngineOptions::tcp_io_timeout);
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
