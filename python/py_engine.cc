// Python binding of kvwire::Engine and its inboxes.
#include <memory>
#include <vector>

#include "python/py_support.h"

namespace kvwire_py {
namespace {

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

}  // namespace

void BindEngine(py::module_& m) {
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
             // Without options: the C++ defaults, then the keyword defaults.
             // With options: exactly those, then only the keywords given.
             kvwire::EngineOptions o = options ? *options : EngineOptionsFor(secret);
             if (options && !secret.is_none()) o.shared_secret = SecretFrom(secret);
             if (name || !options) o.name = name.value_or("");
             if (transport || !options) {
               o.transport = transport.value_or("auto");
             }
             if (listen || !options) o.listen_address = listen.value_or("127.0.0.1:0");
             return Take(kvwire::Engine::Create(o));
           }),
           py::arg("name") = py::none(), py::arg("transport") = py::none(),
           py::arg("listen_address") = py::none(), py::arg("secret") = py::none(),
           py::arg("options") = py::none(),
           "options: a kvwire.EngineOptions used as given (EngineOptions.from_environment() "
           "for the KVWIRE_* environment); without it the C++ defaults, then transport 'auto' "
           "and listen_address '127.0.0.1:0' unless given. secret: the deployment's shared "
           "secret (str or bytes); None: options' secret (none without options)")
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
            if (transport) co.transport = *transport;
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
}

}  // namespace kvwire_py
