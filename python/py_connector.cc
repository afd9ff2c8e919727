// Python binding of kvwire::Connector (the KV connector a serving framework drives).
#include <memory>
#include <vector>

#include "kvwire/connector.h"
#include "kvwire/layout.h"
#include "python/py_support.h"

namespace kvwire_py {

void BindConnector(py::module_& m) {
  py::class_<kvwire::Connector>(m, "Connector")
      .def(py::init([](const std::optional<std::string>& name, const std::optional<std::string>& mode,
                       const std::optional<std::string>& transport,
                       const std::optional<double>& request_timeout_s, const py::object& secret,
                       const std::optional<std::string>& listen_address,
                       const std::optional<std::string>& metrics_address,
                       const std::optional<std::string>& role,
                       const std::optional<double>& handshake_timeout_s,
                       const std::optional<std::string>& etcd_endpoints,
                       const std::optional<std::string>& cluster,
                       const std::optional<double>& etcd_call_timeout_s,
                       const std::optional<int64_t>& etcd_lease_seconds,
                       const std::optional<kvwire::EngineOptions>& engine_options,
                       const std::optional<bool>& read_grants,
                       const std::optional<std::string>& etcd_user,
                       const std::optional<std::string>& etcd_password,
                       const std::optional<std::string>& etcd_ca_file,
                       const std::optional<std::string>& etcd_cert_file,
                       const std::optional<std::string>& etcd_key_file,
                       const std::optional<kvwire::ConnectorOptions>& options) {
             // `options` (or the C++ defaults), then each keyword given. The engine: options'
             // or engine_options as given; with neither, the C++ defaults with transport
             // 'auto' and listen_address '127.0.0.1:0' unless given.
             kvwire::ConnectorOptions o = options.value_or(kvwire::ConnectorOptions());
             const bool engine_given = options.has_value() || engine_options.has_value();
             if (engine_options) o.engine = *engine_options;
             if (!secret.is_none()) o.engine.shared_secret = SecretFrom(secret);
             if (name || !engine_given) o.engine.name = name.value_or("");
             if (transport || !engine_given) o.engine.transport = transport.value_or("auto");
             if (listen_address || !engine_given) {
               o.engine.listen_address = listen_address.value_or("127.0.0.1:0");
             }
             // Durations and numbers as given: the ranges are Connector::Create's
             // (ValidateConnectorOptions), which names the option ("request_timeout: ...").
             auto seconds = [](const char* name, double s) {
               if (s != s) throw py::value_error(absl::StrCat(name, ": not a number"));
               return absl::Seconds(s);
             };
             if (role) o.role = *role;
             if (mode) o.mode = Take(kvwire::ParseKvMode(*mode));
             if (request_timeout_s) {
               o.request_timeout = seconds("request_timeout_s", *request_timeout_s);
             }
             if (handshake_timeout_s) {
               o.handshake_timeout = seconds("handshake_timeout_s", *handshake_timeout_s);
             }
             if (metrics_address) o.metrics_address = *metrics_address;
             if (etcd_endpoints) o.etcd_endpoints = *etcd_endpoints;
             if (cluster) o.cluster = *cluster;
             if (etcd_call_timeout_s) {
               o.etcd_call_timeout = seconds("etcd_call_timeout_s", *etcd_call_timeout_s);
             }
             if (etcd_lease_seconds) o.etcd_lease_seconds = *etcd_lease_seconds;
             if (read_grants) o.read_grants = *read_grants;
             if (etcd_user) o.etcd_user = *etcd_user;
             if (etcd_password) o.etcd_password = *etcd_password;
             if (etcd_ca_file) o.etcd_ca_file = *etcd_ca_file;
             if (etcd_cert_file) o.etcd_cert_file = *etcd_cert_file;
             if (etcd_key_file) o.etcd_key_file = *etcd_key_file;
             return Take(kvwire::Connector::Create(std::move(o)));
           }),
           py::arg("name") = py::none(),
           py::arg("mode") = py::none(), py::arg("transport") = py::none(),
           py::arg("request_timeout_s") = py::none(), py::arg("secret") = py::none(),
           py::arg("listen_address") = py::none(), py::arg("metrics_address") = py::none(),
           py::arg("role") = py::none(), py::arg("handshake_timeout_s") = py::none(),
           py::arg("etcd_endpoints") = py::none(), py::arg("cluster") = py::none(),
           py::arg("etcd_call_timeout_s") = py::none(),
           py::arg("etcd_lease_seconds") = py::none(), py::arg("engine_options") = py::none(),
           py::arg("read_grants") = py::none(), py::arg("etcd_user") = py::none(),
           py::arg("etcd_password") = py::none(), py::arg("etcd_ca_file") = py::none(),
           py::arg("etcd_cert_file") = py::none(), py::arg("etcd_key_file") = py::none(),
           py::arg("options") = py::none(),
           "options: a kvwire.ConnectorOptions (ConnectorOptions.from_environment() for the "
           "KVWIRE_* environment); None: the C++ defaults. Each keyword given replaces its "
           "field (a keyword left None keeps it): the ConnectorOptions fields, durations in "
           "seconds (*_s). engine_options: a kvwire.EngineOptions replacing options.engine; "
           "without either, the C++ defaults, then transport 'auto' and listen_address "
           "'127.0.0.1:0' unless given. secret: the deployment's shared secret (str or bytes). "
           "metrics_address: host:port of GET /metrics and /stats.json (empty: none). "
           "etcd_endpoints + cluster: discovery through etcd (see announce()); "
           "etcd_user/etcd_password: etcd's own authentication; "
           "etcd_ca_file/etcd_cert_file/etcd_key_file: TLS for https:// endpoints. read_grants: "
           "READs of the KV need the request's grant (tcp only); False: zero-copy shm/rdma "
           "READs of the whole KV by any peer with the secret. Connector::Create checks every "
           "option: ValueError naming the option and its range.")
      .def_property_readonly("engine_id", &kvwire::Connector::engine_id)
      .def_property_readonly("address", [](kvwire::Connector& c) { return c.engine().address(); })
      .def_property_readonly("metrics_address", &kvwire::Connector::metrics_address)
      .def_property_readonly("engine", &kvwire::Connector::engine,
                             py::return_value_policy::reference_internal,
                             "the connector's engine (lives as long as the connector)")
      .def(
          "announce",
          [](kvwire::Connector& c, const std::string& http_address) {
            py::gil_scoped_release release;
            Check(c.Announce(http_address));
          },
          py::arg("http_address") = "",
          "Registers this engine in etcd (etcd_endpoints and cluster) with a lease kept alive "
          "until the connector is destroyed; RuntimeError without etcd configured. Call after "
          "register_kv_caches.")
      .def_property_readonly("announced", &kvwire::Connector::Announced,
                             "whether the registration is in etcd now")
      .def(
          "register_kv_caches",
          [](kvwire::Connector& c, const kvwire::Layout& l, const py::list& memory) {
            std::vector<kvwire::KvMemory> mem;
            for (const py::handle& h : memory) mem.push_back(ToKvMemory(h));
            Check(c.RegisterKvCaches(l, mem));
          },
          py::arg("layout"), py::arg("memory"),
          "memory: kvwire.Buffer (host) or kvwire.KvMemory (host or gpu) items")
      .def("get_num_new_matched_tokens",
           [](kvwire::Connector& c, const std::string& id, uint64_t tokens, uint64_t computed,
              const std::string& params) {
             kvwire::MatchResult r = Take(c.GetNumNewMatchedTokens(id, tokens, computed, params));
             return py::make_tuple(r.num_external_tokens, r.load_async);
           })
      .def("update_state_after_alloc",
           [](kvwire::Connector& c, const std::string& id, const kvwire::BlockTable& b,
              uint64_t n) { Check(c.UpdateStateAfterAlloc(id, b, n)); })
      .def("build_connector_meta", &kvwire::Connector::BuildConnectorMeta)
      .def(
          "request_finished",
          [](kvwire::Connector& c, const std::string& id, const kvwire::BlockTable& b,
             uint64_t tokens, const std::string& params, bool aborted,
             const std::string& transfer_id) {
            kvwire::RequestFinishedResult r =
                Take(c.RequestFinished(id, b, tokens, params, aborted, transfer_id));
            return py::make_tuple(r.delay_free, r.kv_transfer_params);
          },
          py::arg("request_id"), py::arg("blocks"), py::arg("num_tokens"),
          py::arg("kv_transfer_params"), py::arg("aborted") = false, py::arg("transfer_id") = "",
          "transfer_id: read mode, the (unguessable) id to hold the blocks under; '': random")
      .def("bind_connector_meta",
           [](kvwire::Connector& c, const std::string& m) { Check(c.BindConnectorMeta(m)); })
      .def("start_load_kv",
           [](kvwire::Connector& c) {
             py::gil_scoped_release release;
             Check(c.StartLoadKv());
           })
      .def("wait_for_layer_load",
           [](kvwire::Connector& c, int layer) {
             py::gil_scoped_release release;
             Check(c.WaitForLayerLoad(layer));
           })
      .def(
          "save_kv_layer",
          [](kvwire::Connector& c, int layer, std::optional<uint64_t> event, int device) {
            if (!event || *event == 0) {
              Check(c.SaveKvLayer(layer));
            } else {
              Check(
                  c.SaveKvLayer(layer, kvwire::GpuEvent{reinterpret_cast<void*>(*event), device}));
            }
          },
          py::arg("layer"), py::arg("event") = py::none(), py::arg("device") = 0,
          "event: the native event handle as an int (torch.cuda.Event().cuda_event) recorded "
          "after the layer's KV was written; returns at once, the layer goes out once it "
          "completed. Keep the event alive until wait_for_save() returns.")
      .def("wait_for_save",
           [](kvwire::Connector& c) {
             py::gil_scoped_release release;
             Check(c.WaitForSave());
           })
      .def("get_finished",
           [](kvwire::Connector& c) {
             kvwire::FinishedRequests f = c.GetFinished();
             std::vector<std::pair<std::string, std::string>> failed;
             for (const kvwire::FailedLoad& l : f.failed_loads) {
               failed.emplace_back(l.request_id, l.reason);
             }
             return py::make_tuple(f.finished_sending, f.finished_recving, failed);
           })
      .def("abort", [](kvwire::Connector& c, const std::string& id) { Check(c.Abort(id)); })
      .def(
          "release_unread",
          [](kvwire::Connector& c, const std::string& id, const std::string& params,
             const std::string& reason) {
            absl::Status s;
            {
              py::gil_scoped_release nogil;  // connects to the prefill ranks
              s = c.ReleaseUnread(id, params, reason);
            }
            Check(s);
          },
          py::arg("request_id"), py::arg("kv_transfer_params"), py::arg("reason"),
          "Decode: tell the prefill rank(s) holding this hand-off to free its blocks now.")
      .def("live_requests", &kvwire::Connector::LiveRequests)
      .def("stats_json", &kvwire::Connector::StatsJson)
      .def(
          "engine_stats_json", [](kvwire::Connector& c) { return c.engine().Stats().ToJson(); },
          "the engine's stats: per peer the transport chosen and why, bytes, transfers")
      .def("stats_prometheus", &kvwire::Connector::StatsPrometheus);

  m.def("parse_kv_transfer_params",
        [](const std::string& j) { return Take(kvwire::KvTransferParams::FromJson(j)).ToJson(); });
}

}  // namespace kvwire_py
