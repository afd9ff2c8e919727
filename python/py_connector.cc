// Python binding of kvwire::Connector (the KV connector a serving framework drives).
#include <memory>
#include <vector>

#include "kvwire/connector.h"
#include "kvwire/layout.h"
#include "python/py_support.h"

namespace kvwire_py {

void BindConnector(py::module_& m) {
  py::class_<kvwire::Connector>(m, "Connector")
      .def(py::init([](const std::optional<std::string>& name, const std::string& mode,
                       const std::optional<std::string>& transport, double request_timeout_s,
                       const py::object& secret, const std::optional<std::string>& listen_address,
                       const std::string& metrics_address, const std::string& role,
                       double handshake_timeout_s, const std::string& etcd_endpoints,
                       const std::string& cluster, double etcd_call_timeout_s,
                       int64_t etcd_lease_seconds,
                       const std::optional<kvwire::EngineOptions>& engine_options, bool read_grants,
                       const std::string& etcd_user, const std::string& etcd_password,
                       const std::string& etcd_ca_file, const std::string& etcd_cert_file,
                       const std::string& etcd_key_file) {
             kvwire::ConnectorOptions o;
             // Without engine_options: the C++ defaults, then the keyword defaults.
             // With them: exactly those, then only the engine keywords given.
             o.engine = engine_options ? *engine_options : EngineOptionsFor(secret);
             if (engine_options && !secret.is_none()) o.engine.shared_secret = SecretFrom(secret);
             if (name || !engine_options) o.engine.name = name.value_or("");
             if (transport || !engine_options) {
               o.engine.transport = transport.value_or("auto");
             }
             if (listen_address || !engine_options) {
               o.engine.listen_address = listen_address.value_or("127.0.0.1:0");
             }
             o.role = role;
             o.mode = Take(kvwire::ParseKvMode(mode));
             o.request_timeout = FromSeconds("request_timeout_s", request_timeout_s);
             o.handshake_timeout = FromSeconds("handshake_timeout_s", handshake_timeout_s);
             o.metrics_address = metrics_address;
             o.etcd_endpoints = etcd_endpoints;
             o.cluster = cluster;
             if (!(etcd_call_timeout_s > 0 && etcd_call_timeout_s <= 600)) {
               throw py::value_error(absl::StrCat("etcd_call_timeout_s: ", etcd_call_timeout_s,
                                                  " s is out of range (0 < s <= 600)"));
             }
             o.etcd_call_timeout = absl::Seconds(etcd_call_timeout_s);
             o.etcd_lease_seconds =
                 InRange<int64_t>("etcd_lease_seconds", etcd_lease_seconds, 1, 86400);
             o.read_grants = read_grants;
             o.etcd_user = etcd_user;
             o.etcd_password = etcd_password;
             o.etcd_ca_file = etcd_ca_file;
             o.etcd_cert_file = etcd_cert_file;
             o.etcd_key_file = etcd_key_file;
             return Take(kvwire::Connector::Create(o));
           }),
           py::arg("name") = py::none(), py::arg("mode") = "auto",
           py::arg("transport") = py::none(), py::arg("request_timeout_s") = 60.0,
           py::arg("secret") = py::none(), py::arg("listen_address") = py::none(),
           py::arg("metrics_address") = "", py::arg("role") = "both",
           py::arg("handshake_timeout_s") = 10.0, py::arg("etcd_endpoints") = "",
           py::arg("cluster") = "", py::arg("etcd_call_timeout_s") = 2.0,
           py::arg("etcd_lease_seconds") = 10, py::arg("engine_options") = py::none(),
           py::arg("read_grants") = true, py::arg("etcd_user") = "", py::arg("etcd_password") = "",
           py::arg("etcd_ca_file") = "", py::arg("etcd_cert_file") = "",
           py::arg("etcd_key_file") = "",
           "Every field of ConnectorOptions. engine_options: a kvwire.EngineOptions used as "
           "given (EngineOptions.from_environment() for the KVWIRE_* environment); without it "
           "the C++ defaults, then transport 'auto' and listen_address '127.0.0.1:0' unless "
           "given. secret: the deployment's shared secret (str or bytes); None: "
           "engine_options' secret (none without them). metrics_address: host:port of "
           "GET /metrics and /stats.json (empty: none). etcd_endpoints + cluster: discovery "
           "through etcd (see announce()); etcd_user/etcd_password: etcd's own "
           "authentication; etcd_ca_file/etcd_cert_file/etcd_key_file: TLS for https:// "
           "endpoints (empty fields: KVWIRE_ETCD_*). read_grants: READs of the KV need the "
           "request's grant (tcp only); False: zero-copy shm/rdma READs of the whole KV by any "
           "peer with the secret.")
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
