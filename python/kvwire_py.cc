// Python binding (pybind11, Debian's pybind11-dev) of the engine, layouts and connector.
// Errors become RuntimeError (ValueError for invalid arguments) with the status message.
#include <memory>
#include <optional>
#include <string>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "absl/strings/str_cat.h"

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
std::string SecretFrom(const py::object& secret) {
  if (!py::isinstance<py::bytes>(secret) && !py::isinstance<py::str>(secret)) {
    throw py::type_error("secret must be str, bytes or None");
  }
  return secret.cast<std::string>();
}
kvwire::EngineOptions EngineOptionsFor(const py::object& secret) {
  kvwire::EngineOptions o = kvwire::EngineOptions::FromEnvironment({});
  if (!secret.is_none()) o.shared_secret = SecretFrom(secret);
  return o;
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }
// A duration option in seconds: positive and finite (0 < s <= 1 day), else ValueError naming it.
absl::Duration FromSeconds(const char* name, double s) {
  if (!(s > 0 && s <= 86400)) {
    throw py::value_error(absl::StrCat(name, ": ", s, " s is out of range (0 < s <= 86400)"));
  }
  return absl::Seconds(s);
}
// Inbox events as [(kind, peer, peer_name, payload bytes)].
py::list EventList(const std::vector<kvwire::InboxEvent>& events) {
  py::list out;
  for (const kvwire::InboxEvent& ev : events) {
    out.append(
        py::make_tuple(ev.kind == kvwire::InboxEvent::Kind::kPeerClosed ? "peer_closed" : "message",
                       ev.peer, ev.peer_name, py::bytes(ev.payload)));
  }
  return out;
}
// An integer option within [lo, hi], else ValueError naming it and the range (the C API's
// setters accept the same ranges).
template <typename T>
T InRange(const char* name, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    throw py::value_error(absl::StrCat(name, ": ", v, " is out of range (", lo, "..", hi, ")"));
  }
  return static_cast<T>(v);
}

// Python's kvwire.EngineOptions: every field of kvwire::EngineOptions, durations as float
// seconds (*_s), the transport as its name, numbers range-checked on assignment.
template <typename T, int64_t kLo, int64_t kHi>
void IntField(py::class_<kvwire::EngineOptions>& c, const char* name,
              T kvwire::EngineOptions::*field) {
  c.def_property(
      name, [field](const kvwire::EngineOptions& o) { return o.*field; },
      [name, field](kvwire::EngineOptions& o, int64_t v) {
        o.*field = InRange<T>(name, v, kLo, kHi);
      });
}
void DurationField(py::class_<kvwire::EngineOptions>& c, const char* name,
                   absl::Duration kvwire::EngineOptions::*field) {
  c.def_property(
      name, [field](const kvwire::EngineOptions& o) { return Seconds(o.*field); },
      [name, field](kvwire::EngineOptions& o, double s) { o.*field = FromSeconds(name, s); });
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
      .def_readonly("section_row_bytes", &kvwire::CacheGroup::section_row_bytes)
      .def_readonly("num_blocks", &kvwire::CacheGroup::num_blocks)
      .def("block_address", &kvwire::CacheGroup::BlockAddress, py::arg("layer_index"),
           py::arg("block"), py::arg("component") = 0)
      .def(
          "unfilled_page_spans",
          [](const kvwire::CacheGroup& g, uint64_t logical_block, uint64_t num_tokens) {
            std::vector<std::pair<uint64_t, uint64_t>> out;
            for (const kvwire::PageSpan& s :
                 Take(kvwire::UnfilledPageSpans(g, logical_block, num_tokens))) {
              out.emplace_back(s.offset, s.length);
            }
            return out;
          },
          py::arg("logical_block"), py::arg("num_tokens"),
          "(offset, length) of the bytes of a page of this logical block that a request of "
          "num_tokens tokens did not fill: what a read grant clears first");

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

  // --- kvwire.EngineOptions ---
  constexpr int64_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024, kTiB = kGiB * 1024;
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
  IntField<int, 1, 64>(eo, "tcp_connections", &kvwire::EngineOptions::tcp_connections);
  IntField<uint64_t, 1, 64 * kMiB>(eo, "max_op_bytes", &kvwire::EngineOptions::max_op_bytes);
  IntField<uint64_t, 0, kTiB>(eo, "stripe_min_bytes", &kvwire::EngineOptions::stripe_min_bytes);
  IntField<uint32_t, 4 * kKiB, kGiB>(eo, "max_frame_bytes",
                                     &kvwire::EngineOptions::max_frame_bytes);
  DurationField(eo, "heartbeat_interval_s", &kvwire::EngineOptions::heartbeat_interval);
  DurationField(eo, "peer_lease_s", &kvwire::EngineOptions::peer_lease);
  DurationField(eo, "connect_timeout_s", &kvwire::EngineOptions::connect_timeout);
  DurationField(eo, "transfer_timeout_s", &kvwire::EngineOptions::transfer_timeout);
  IntField<int, 1, 64>(eo, "io_threads", &kvwire::EngineOptions::io_threads);
  IntField<uint32_t, 1, kGiB>(eo, "max_message_bytes", &kvwire::EngineOptions::max_message_bytes);
  IntField<int, -1, 1023>(eo, "rdma_gid_index", &kvwire::EngineOptions::rdma_gid_index);
  IntField<int, 1, 64>(eo, "rdma_qps_per_peer", &kvwire::EngineOptions::rdma_qps_per_peer);
  IntField<int, 1, 32768>(eo, "rdma_send_queue_depth",
                          &kvwire::EngineOptions::rdma_send_queue_depth);
  IntField<int, 0, 31>(eo, "rdma_qp_timeout", &kvwire::EngineOptions::rdma_qp_timeout);
  IntField<int, 0, 7>(eo, "rdma_retry_count", &kvwire::EngineOptions::rdma_retry_count);
  IntField<int, 0, 7>(eo, "rdma_rnr_retry", &kvwire::EngineOptions::rdma_rnr_retry);
  IntField<int, 1, 1 << 20>(eo, "tcp_max_data_connections",
                            &kvwire::EngineOptions::tcp_max_data_connections);
  IntField<int, 1, 1 << 16>(eo, "tcp_max_data_connections_per_peer",
                            &kvwire::EngineOptions::tcp_max_data_connections_per_peer);
  IntField<int, 1, 1 << 16>(eo, "tcp_max_pending_hellos",
                            &kvwire::EngineOptions::tcp_max_pending_hellos);
  IntField<int, 1, 1 << 16>(eo, "tcp_max_pending_hellos_per_address",
                            &kvwire::EngineOptions::tcp_max_pending_hellos_per_address);
  DurationField(eo, "tcp_hello_timeout_s", &kvwire::EngineOptions::tcp_hello_timeout);
  DurationField(eo, "tcp_io_timeout_s", &kvwire::EngineOptions::tcp_io_timeout);
  IntField<int, 1, 1 << 16>(eo, "max_pending_handshakes",
                            &kvwire::EngineOptions::max_pending_handshakes);
  IntField<int, 1, 1 << 16>(eo, "max_pending_handshakes_per_source",
                            &kvwire::EngineOptions::max_pending_handshakes_per_source);
  IntField<int, 1, 1 << 20>(eo, "max_control_connections",
                            &kvwire::EngineOptions::max_control_connections);
  IntField<uint64_t, 4 * kKiB, kTiB>(eo, "max_control_send_queue_bytes",
                                     &kvwire::EngineOptions::max_control_send_queue_bytes);
  IntField<uint64_t, 1, int64_t{1} << 32>(eo, "max_undrained_notifications",
                                          &kvwire::EngineOptions::max_undrained_notifications);
  IntField<int, 0, 1 << 16>(eo, "closed_peers_kept", &kvwire::EngineOptions::closed_peers_kept);

  py::class_<kvwire::Inbox, std::shared_ptr<kvwire::Inbox>>(m, "Inbox")
      .def_property_readonly("topic", &kvwire::Inbox::topic)
      .def("take", [](kvwire::Inbox& in) { return EventList(in.Take()); })
      .def(
          "wait",
          [](kvwire::Inbox& in, double timeout_s) {
            std::vector<kvwire::InboxEvent> events;
            {
              py::gil_scoped_release release;
              events = in.Wait(FromSeconds("timeout_s", timeout_s));
            }
            return EventList(events);
          },
          py::arg("timeout_s") = 10.0, "[(kind, peer, peer_name, payload bytes)]");

  py::class_<kvwire::Engine>(m, "Engine")
      .def(py::init([](const std::optional<std::string>& name,
                       const std::optional<std::string>& transport,
                       const std::optional<std::string>& listen, const py::object& secret,
                       const std::optional<kvwire::EngineOptions>& options) {
             // Without options: the environment, then the keyword defaults (as before).
             // With options: exactly those, then only the keywords given.
             kvwire::EngineOptions o = options ? *options : EngineOptionsFor(secret);
             if (options && !secret.is_none()) o.shared_secret = SecretFrom(secret);
             if (name || !options) o.name = name.value_or("");
             if (transport || !options) {
               o.transport = Take(kvwire::ParseTransportKind(transport.value_or("auto")));
             }
             if (listen || !options) o.listen_address = listen.value_or("127.0.0.1:0");
             return Take(kvwire::Engine::Create(o));
           }),
           py::arg("name") = py::none(), py::arg("transport") = py::none(),
           py::arg("listen_address") = py::none(), py::arg("secret") = py::none(),
           py::arg("options") = py::none(),
           "options: a kvwire.EngineOptions (used as given: no environment); without it the "
           "KVWIRE_* environment, then transport 'auto' and listen_address '127.0.0.1:0' unless "
           "given. secret: the deployment's shared secret (str or bytes); None: KVWIRE_SECRET")
      .def_property_readonly("name", &kvwire::Engine::name)
      .def_property_readonly("address", &kvwire::Engine::address)
      .def(
          "register_memory",
          [](kvwire::Engine& e, Buffer& b, uint32_t access, bool export_to_all_peers) {
            kvwire::RegionOptions ro;
            ro.access =
                InRange<uint32_t>("access", access, kvwire::kAccessNone, kvwire::kRemoteReadWrite);
            ro.export_to_all_peers = export_to_all_peers;
            return Take(e.RegisterMemory(b.rep.data(), b.rep.size(), ro));
          },
          py::arg("buffer"), py::arg("access") = 3, py::arg("export_to_all_peers") = true,
          "access: 0 none, 1 remote read, 2 remote write, 3 both (RegionOptions' default). "
          "export_to_all_peers defaults to True here (RegionOptions' default is False)")
      .def(
          "register_kv_memory",
          [](kvwire::Engine& e, const kvwire::KvMemory& km, uint32_t access,
             bool export_to_all_peers) {
            kvwire::RegionOptions ro;
            ro.access =
                InRange<uint32_t>("access", access, kvwire::kAccessNone, kvwire::kRemoteReadWrite);
            ro.kind = km.kind;
            ro.gpu_device = km.gpu_device;
            ro.export_to_all_peers = export_to_all_peers;
            return Take(e.RegisterMemory(km.ptr, km.length, ro));
          },
          py::arg("memory"), py::arg("access") = 3, py::arg("export_to_all_peers") = false,
          "Registers a kvwire.KvMemory range (host or gpu) with RegionOptions' defaults")
      .def("deregister_memory",
           [](kvwire::Engine& e, uint64_t region) {
             py::gil_scoped_release release;
             Check(e.DeregisterMemory(region));
           })
      .def(
          "connect",
          [](kvwire::Engine& e, const std::string& a, const std::vector<uint64_t>& exports,
             const std::optional<std::string>& transport) {
            kvwire::ConnectOptions co;
            co.exports = exports;
            if (transport) co.transport = Take(kvwire::ParseTransportKind(*transport));
            py::gil_scoped_release release;
            return Take(e.Connect(a, co));
          },
          py::arg("address"), py::arg("exports") = std::vector<uint64_t>(),
          py::arg("transport") = py::none())
      .def("export", [](kvwire::Engine& e, uint64_t peer,
                        const std::vector<uint64_t>& regions) { Check(e.Export(peer, regions)); })
      .def("unexport",
           [](kvwire::Engine& e, uint64_t peer, const std::vector<uint64_t>& regions) {
             py::gil_scoped_release release;
             Check(e.Unexport(peer, regions));
           })
      .def(
          "disconnect",
          [](kvwire::Engine& e, uint64_t peer, const std::optional<std::string>& reason) {
            py::gil_scoped_release release;
            Check(reason ? e.Disconnect(peer, absl::AbortedError(*reason)) : e.Disconnect(peer));
          },
          py::arg("peer"), py::arg("reason") = py::none())
      .def("peers",
           [](const kvwire::Engine& e) {
             py::list out;
             for (const kvwire::PeerInfo& p : e.Peers()) {
               py::dict d;
               d["id"] = p.id;
               d["name"] = p.name;
               d["address"] = p.address;
               d["transport"] = p.transport;
               d["alive"] = p.alive;
               d["close_reason"] = p.close_reason;
               out.append(d);
             }
             return out;
           })
      .def("find_peer",
           [](const kvwire::Engine& e, const std::string& name) { return Take(e.FindPeer(name)); })
      .def(
          "wait_for_peer",
          [](kvwire::Engine& e, const std::string& name, double timeout_s) {
            py::gil_scoped_release release;
            return Take(e.WaitForPeer(name, FromSeconds("timeout_s", timeout_s)));
          },
          py::arg("name"), py::arg("timeout_s") = 10.0)
      .def(
          "wait_for_remote_region",
          [](kvwire::Engine& e, uint64_t peer, uint64_t region, double timeout_s) {
            py::gil_scoped_release release;
            Check(e.WaitForRemoteRegion(peer, region, FromSeconds("timeout_s", timeout_s)));
          },
          py::arg("peer"), py::arg("region"), py::arg("timeout_s") = 10.0)
      .def(
          "poll",
          [](kvwire::Engine& e, uint64_t id) {
            absl::Status status;
            switch (e.Poll(id, &status)) {
              case kvwire::TransferState::kPending:
                return py::make_tuple("pending", py::none());
              case kvwire::TransferState::kSucceeded:
                return py::make_tuple("succeeded", py::none());
              case kvwire::TransferState::kFailed:
                break;
            }
            return py::make_tuple("failed", status.ToString());
          },
          "(state, error): 'pending', 'succeeded' or 'failed' (with the error); a final state "
          "is reported once")
      .def(
          "take_notifications",
          [](kvwire::Engine& e) {
            py::list out;
            for (const kvwire::Notification& n : e.TakeNotifications()) {
              out.append(py::make_tuple(n.peer, n.peer_name, n.transfer_id, py::bytes(n.payload)));
            }
            return out;
          },
          "[(peer, peer_name, transfer_id, payload bytes)]")
      .def(
          "wait_notification",
          [](kvwire::Engine& e, double timeout_s) {
            absl::StatusOr<kvwire::Notification> n;
            {
              py::gil_scoped_release release;
              n = e.WaitNotification(FromSeconds("timeout_s", timeout_s));
            }
            kvwire::Notification v = Take(std::move(n));
            return py::make_tuple(v.peer, v.peer_name, v.transfer_id, py::bytes(v.payload));
          },
          py::arg("timeout_s") = 10.0)
      .def(
          "send_message",
          [](kvwire::Engine& e, uint64_t peer, const std::string& topic, const py::bytes& payload) {
            Check(e.SendMessage(peer, topic, std::string(payload)));
          })
      .def(
          "open_inbox",
          [](kvwire::Engine& e, const std::string& topic, uint64_t max_queued_bytes,
             bool peer_events) {
            kvwire::InboxOptions io;
            io.max_queued_bytes = InRange<uint64_t>(
                "max_queued_bytes", static_cast<int64_t>(max_queued_bytes), 1, int64_t{1} << 40);
            io.peer_events = peer_events;
            return std::shared_ptr<kvwire::Inbox>(Take(e.OpenInbox(topic, io)));
          },
          py::arg("topic"), py::arg("max_queued_bytes") = uint64_t{64} << 20,
          py::arg("peer_events") = true)
      .def("stats_prometheus",
           [](const kvwire::Engine& e) { return e.Stats().ToPrometheus(e.name()); })
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
             std::optional<std::string> notification, std::optional<double> timeout_s) {
            if (kind != "read" && kind != "write") {
              throw py::value_error("transfer kind must be 'read' or 'write', not '" + kind + "'");
            }
            std::vector<kvwire::Op> v;
            for (const auto& [lr, lo, rr, ro, len] : ops) v.push_back({lr, lo, rr, ro, len});
            kvwire::TransferOptions to;
            to.notification = notification;
            if (timeout_s) to.timeout = FromSeconds("timeout_s", *timeout_s);
            py::gil_scoped_release release;
            return Take(e.Transfer(
                peer, kind == "write" ? kvwire::OpKind::kWrite : kvwire::OpKind::kRead, v, to));
          },
          py::arg("peer"), py::arg("kind"), py::arg("ops"), py::arg("notification") = py::none(),
          py::arg("timeout_s") = py::none())
      .def(
          "wait",
          [](kvwire::Engine& e, uint64_t id, double timeout_s) {
            py::gil_scoped_release release;
            Check(e.Wait(id, absl::Seconds(timeout_s)));
          },
          py::arg("transfer"), py::arg("timeout_s") = 30.0)
      .def("stats_json", [](const kvwire::Engine& e) { return e.Stats().ToJson(); });

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
             // Without engine_options: the environment, then the keyword defaults (as before).
             // With them: exactly those, then only the engine keywords given.
             o.engine = engine_options ? *engine_options : EngineOptionsFor(secret);
             if (engine_options && !secret.is_none()) o.engine.shared_secret = SecretFrom(secret);
             if (name || !engine_options) o.engine.name = name.value_or("");
             if (transport || !engine_options) {
               o.engine.transport = Take(kvwire::ParseTransportKind(transport.value_or("auto")));
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
           "given (no environment); without it the KVWIRE_* environment, then transport 'auto' "
           "and listen_address '127.0.0.1:0' unless given. secret: the deployment's shared "
           "secret (str or bytes); None: KVWIRE_SECRET. metrics_address: host:port of "
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
