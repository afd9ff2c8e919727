// Python binding (pybind11, Debian's pybind11-dev) of the engine, layouts and connector.
// Errors become RuntimeError (ValueError for invalid arguments) with the status message.
#include <memory>
#include <optional>
#include <string>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kvwire/connector.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"

namespace py = pybind11;

namespace {

[[noreturn]] void Throw(const absl::Status& s) {
  if (absl::IsInvalidArgument(s)) throw py::value_error(s.ToString());
  throw std::runtime_error(s.ToString());
}
void Check(const absl::Status& s) {
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
kvwire::KvMemory ToKvMemory(const py::handle& h) {
  if (py::isinstance<Buffer>(h)) {
    const Buffer& b = h.cast<const Buffer&>();
    return {b.rep.data(), b.rep.size()};
  }
  if (py::isinstance<kvwire::KvMemory>(h)) return h.cast<kvwire::KvMemory>();
  throw py::type_error("register_kv_caches: expected kvwire.Buffer or kvwire.KvMemory items");
}

// The engine options of a Python-made engine or connector: the KVWIRE_* environment first
// (EngineOptions::FromEnvironment, the one place it is read), then `secret` when given (str,
// UTF-8, or bytes; "" / b"" means none).
kvwire::EngineOptions EngineOptionsFor(const py::object& secret) {
  kvwire::EngineOptions o = kvwire::EngineOptions::FromEnvironment({});
  if (secret.is_none()) return o;
  if (!py::isinstance<py::bytes>(secret) && !py::isinstance<py::str>(secret)) {
    throw py::type_error("secret must be str, bytes or None");
  }
  o.shared_secret = secret.cast<std::string>();
  return o;
}

}  // namespace

PYBIND11_MODULE(_kvwire, m) {
  m.doc() = "kvwire: KV-cache transfer engine, layouts and connector";

  py::class_<Buffer>(m, "Buffer", py::buffer_protocol())
      .def(py::init([](size_t length) {
        return Buffer{Take(kvwire::ShareableBuffer::Create(length, "kvwire-py"))};
      }))
      .def_property_readonly(
          "address", [](const Buffer& b) { return reinterpret_cast<uint64_t>(b.rep.data()); })
      .def("__len__", [](const Buffer& b) { return b.rep.size(); })
      .def_buffer([](Buffer& b) {
        return py::buffer_info(b.rep.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {b.rep.size()}, {1});
      });

  py::class_<kvwire::KvMemory>(m, "KvMemory")
      .def(py::init([](uint64_t ptr, size_t length, const std::string& kind, int gpu_device) {
             if (kind != "host" && kind != "gpu") {
               throw py::value_error("KvMemory kind must be 'host' or 'gpu', not '" + kind + "'");
             }
             kvwire::KvMemory km;
             km.ptr = reinterpret_cast<void*>(ptr);
             km.length = length;
             km.kind = kind == "gpu" ? kvwire::MemoryKind::kGpu : kvwire::MemoryKind::kHost;
             km.gpu_device = gpu_device;
             return km;
           }),
           py::arg("ptr"), py::arg("length"), py::arg("kind") = "host", py::arg("gpu_device") = -1,
           "A registered range: host memory, or GPU memory ('gpu', e.g. a CUDA tensor's "
           "data_ptr(); gpu_device -1 asks the runtime)")
      .def_property_readonly(
          "ptr", [](const kvwire::KvMemory& k) { return reinterpret_cast<uint64_t>(k.ptr); })
      .def_readonly("length", &kvwire::KvMemory::length)
      .def_property_readonly("kind",
                             [](const kvwire::KvMemory& k) {
                               return k.kind == kvwire::MemoryKind::kGpu ? "gpu" : "host";
                             })
      .def_readonly("gpu_device", &kvwire::KvMemory::gpu_device);

  py::class_<kvwire::CacheGroup>(m, "CacheGroup")
      .def_readonly("name", &kvwire::CacheGroup::name)
      .def_readonly("layers", &kvwire::CacheGroup::layers)
      .def_readonly("tokens_per_block", &kvwire::CacheGroup::tokens_per_block)
      .def_readonly("page_bytes", &kvwire::CacheGroup::page_bytes)
      .def_readonly("tokens_per_entry", &kvwire::CacheGroup::tokens_per_entry)
      .def_readonly("window_tokens", &kvwire::CacheGroup::window_tokens)
      .def_readonly("per_request_state", &kvwire::CacheGroup::per_request_state)
      .def_readonly("components", &kvwire::CacheGroup::components)
      .def_readonly("num_blocks", &kvwire::CacheGroup::num_blocks)
      .def("block_address", &kvwire::CacheGroup::BlockAddress, py::arg("layer_index"),
           py::arg("block"), py::arg("component") = 0);

  py::class_<kvwire::Layout>(m, "Layout")
      .def_static("preset", [](const std::string& n) { return Take(kvwire::PresetLayout(n)); })
      .def_static("from_json", [](const std::string& j) { return Take(kvwire::LayoutFromJson(j)); })
      .def("to_json", [](const kvwire::Layout& l) { return kvwire::LayoutToJson(l); })
      .def_readonly("model", &kvwire::Layout::model)
      .def_readonly("groups", &kvwire::Layout::groups)
      .def("group",
           [](const kvwire::Layout& l, const std::string& name) {
             const kvwire::CacheGroup* g = l.FindGroup(name);
             if (g == nullptr) throw py::key_error(name);
             return *g;
           })
      .def(
          "assign_backing",
          [](kvwire::Layout& l, uint64_t base, uint64_t blocks, uint64_t state_blocks) {
            return kvwire::AssignBacking(&l, base, blocks, state_blocks);
          },
          py::arg("base"), py::arg("num_blocks"), py::arg("state_blocks") = 0)
      .def("check_compatible", [](const kvwire::Layout& prefill, const kvwire::Layout& decode) {
        Check(kvwire::CheckCompatible(prefill, decode));
      });

  m.def(
      "select_blocks",
      [](const kvwire::CacheGroup& g, uint64_t tokens, uint64_t cached) {
        kvwire::BlockSelection s = kvwire::SelectBlocks(g, tokens, cached);
        return py::make_tuple(s.logical_blocks, s.slot_begin, s.slot_count);
      },
      py::arg("group"), py::arg("num_tokens"), py::arg("num_cached_tokens") = 0,
      "(logical blocks, state slot begin, state slot count) that move for a request");
  m.def(
      "plan_transfer",
      [](const kvwire::Layout& src, const kvwire::BlockTable& sb, const kvwire::Layout& dst,
         const kvwire::BlockTable& db, uint64_t tokens, uint64_t cached) {
        kvwire::TransferPlan p = Take(kvwire::PlanTransfer(src, sb, dst, db, tokens, cached));
        py::dict d;
        d["bytes"] = p.bytes;
        d["ops_before_merge"] = p.ops_before_merge;
        d["ops_after_merge"] = p.ops_after_merge;
        return d;
      },
      py::arg("src"), py::arg("src_blocks"), py::arg("dst"), py::arg("dst_blocks"),
      py::arg("num_tokens"), py::arg("num_cached_tokens") = 0);

  py::class_<kvwire::Engine>(m, "Engine")
      .def(py::init([](const std::string& name, const std::string& transport,
                       const std::string& listen, const py::object& secret) {
             kvwire::EngineOptions o = EngineOptionsFor(secret);
             o.name = name;
             o.transport = Take(kvwire::ParseTransportKind(transport));
             o.listen_address = listen;
             return Take(kvwire::Engine::Create(o));
           }),
           py::arg("name") = "", py::arg("transport") = "auto",
           py::arg("listen_address") = "127.0.0.1:0", py::arg("secret") = py::none(),
           "secret: the deployment's shared secret (str or bytes); None: KVWIRE_SECRET")
      .def_property_readonly("name", &kvwire::Engine::name)
      .def_property_readonly("address", &kvwire::Engine::address)
      .def("register_memory",
           [](kvwire::Engine& e, Buffer& b) {
             kvwire::RegionOptions ro;
             ro.export_to_all_peers = true;
             return Take(e.RegisterMemory(b.rep.data(), b.rep.size(), ro));
           })
      .def("connect", [](kvwire::Engine& e, const std::string& a) { return Take(e.Connect(a)); })
      .def("remote_regions",
           [](kvwire::Engine& e, uint64_t peer) {
             std::vector<py::tuple> out;
             for (const kvwire::RemoteRegion& r : Take(e.RemoteRegions(peer))) {
               out.push_back(py::make_tuple(r.id, r.length));
             }
             return out;
           })
      .def(
          "transfer",
          [](kvwire::Engine& e, uint64_t peer, const std::string& kind,
             const std::vector<std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>>& ops,
             std::optional<std::string> notification) {
            std::vector<kvwire::Op> v;
            for (const auto& [lr, lo, rr, ro, len] : ops) v.push_back({lr, lo, rr, ro, len});
            kvwire::TransferOptions to;
            to.notification = notification;
            py::gil_scoped_release release;
            return Take(e.Transfer(
                peer, kind == "write" ? kvwire::OpKind::kWrite : kvwire::OpKind::kRead, v, to));
          },
          py::arg("peer"), py::arg("kind"), py::arg("ops"), py::arg("notification") = py::none())
      .def(
          "wait",
          [](kvwire::Engine& e, uint64_t id, double timeout_s) {
            py::gil_scoped_release release;
            Check(e.Wait(id, absl::Seconds(timeout_s)));
          },
          py::arg("transfer"), py::arg("timeout_s") = 30.0)
      .def("stats_json", [](const kvwire::Engine& e) { return e.Stats().ToJson(); });

  py::class_<kvwire::Connector>(m, "Connector")
      .def(py::init([](const std::string& name, const std::string& mode,
                       const std::string& transport, double request_timeout_s,
                       const py::object& secret, const std::string& listen_address,
                       const std::string& metrics_address) {
             kvwire::ConnectorOptions o;
             o.engine = EngineOptionsFor(secret);
             o.engine.name = name;
             o.mode = Take(kvwire::ParseKvMode(mode));
             o.engine.transport = Take(kvwire::ParseTransportKind(transport));
             o.engine.listen_address = listen_address;
             o.request_timeout = absl::Seconds(request_timeout_s);
             o.metrics_address = metrics_address;
             return Take(kvwire::Connector::Create(o));
           }),
           py::arg("name") = "", py::arg("mode") = "auto", py::arg("transport") = "auto",
           py::arg("request_timeout_s") = 60.0, py::arg("secret") = py::none(),
           py::arg("listen_address") = "127.0.0.1:0", py::arg("metrics_address") = "",
           "secret: the deployment's shared secret (str or bytes); None: KVWIRE_SECRET. "
           "listen_address: control channel host:port (port 0: a free one). metrics_address: "
           "host:port of GET /metrics and /stats.json (empty: none)")
      .def_property_readonly("engine_id", &kvwire::Connector::engine_id)
      .def_property_readonly("address", [](kvwire::Connector& c) { return c.engine().address(); })
      .def_property_readonly("metrics_address", &kvwire::Connector::metrics_address)
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
      .def("live_requests", &kvwire::Connector::LiveRequests)
      .def("stats_json", &kvwire::Connector::StatsJson)
      .def(
          "engine_stats_json", [](kvwire::Connector& c) { return c.engine().Stats().ToJson(); },
          "the engine's stats: per peer the transport chosen and why, bytes, transfers")
      .def("stats_prometheus", &kvwire::Connector::StatsPrometheus);

  m.def("parse_kv_transfer_params",
        [](const std::string& j) { return Take(kvwire::KvTransferParams::FromJson(j)).ToJson(); });
}
