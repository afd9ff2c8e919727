"""The Python binding's options and the engine surface: kvwire.EngineOptions (every field of
kvwire::EngineOptions, checked by Engine() as C++ and C check them),
EngineOptions.from_environment's precedence, two engines moving bytes over tcp with the new
engine calls, every ConnectorOptions field, and Connector.announce() against a real
etcd-server started by the test."""
import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.request

import kvwire

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineOptionsTest(unittest.TestCase):
    def test_defaults_are_the_cpp_defaults(self):
        o = kvwire.EngineOptions()
        self.assertEqual(o.listen_address, "127.0.0.1:0")
        self.assertEqual(o.transport, "auto")
        self.assertEqual(o.tcp_connections, 4)
        self.assertEqual(o.max_op_bytes, 1 << 20)
        self.assertEqual(o.peer_lease_s, 5.0)
        self.assertEqual(o.heartbeat_interval_s, 0.5)
        self.assertEqual(o.rdma_gid_index, -1)
        self.assertEqual(o.shared_secret, b"")
        self.assertFalse(o.shm_cma)

    def refused(self, name, value, pattern):
        """Sets one option; the setter (when the field's type cannot hold the value) or
        Engine() (Engine::Create's one validator) refuses it with ValueError matching pattern."""
        o = kvwire.EngineOptions()
        with self.assertRaisesRegex(ValueError, pattern):
            setattr(o, name, value)
            kvwire.Engine(options=o)

    def test_every_numeric_field_takes_its_range_and_refuses_beyond(self):
        ranges = {
            "tcp_connections": (1, 64), "max_op_bytes": (1, 64 << 20),
            "stripe_min_bytes": (0, 1 << 40), "max_frame_bytes": (4096, 1 << 30),
            "io_threads": (1, 64), "max_message_bytes": (1, 1 << 30),
            "rdma_gid_index": (-1, 1023), "rdma_qps_per_peer": (1, 64),
            "rdma_send_queue_depth": (16, 16384), "rdma_qp_timeout": (0, 31),
            "rdma_retry_count": (0, 7), "rdma_rnr_retry": (0, 7),
            "rdma_max_qps_per_device": (0, 1 << 24),
            "tcp_max_data_connections": (1, 1 << 20),
            "tcp_max_data_connections_per_peer": (1, 1 << 16),
            "tcp_max_pending_hellos": (1, 1 << 16),
            "tcp_max_pending_hellos_per_address": (1, 1 << 16),
            "max_pending_handshakes": (1, 1 << 16),
            "max_pending_handshakes_per_source": (1, 1 << 16),
            "max_control_connections": (1, 1 << 20),
            "max_control_send_queue_bytes": (4096, 1 << 40),
            "max_undrained_notifications": (1, 1 << 32), "closed_peers_kept": (0, 1 << 16),
        }
        o = kvwire.EngineOptions()
        for name, (lo, hi) in ranges.items():
            with self.subTest(name=name):
                setattr(o, name, lo)
                self.assertEqual(getattr(o, name), lo)
                setattr(o, name, hi)
                self.assertEqual(getattr(o, name), hi)
                self.refused(name, hi + 1, f"{name}: {hi + 1} is out of range")
                self.refused(name, lo - 1, f"{name}: {lo - 1} is out of range")
        for name in ("heartbeat_interval_s", "peer_lease_s", "connect_timeout_s",
                     "transfer_timeout_s", "tcp_hello_timeout_s", "tcp_io_timeout_s"):
            with self.subTest(name=name):
                setattr(o, name, 1.5)
                self.assertAlmostEqual(getattr(o, name), 1.5)
                for bad in (0, -1, float("nan"), 1e9):
                    self.refused(name, bad, name[:-2])

    def test_shared_table_of_bad_values(self):
        """tests/support/bad_engine_options.tsv: the same message as C++ and C give."""
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                            "support", "bad_engine_options.tsv")
        rows = 0
        with open(path) as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                option, kind, value, want = line.rstrip("\n").split("\t")
                rows += 1
                with self.subTest(option=option, value=value):
                    o = kvwire.EngineOptions()
                    if kind == "ms":
                        setattr(o, option + "_s", int(value) / 1000)
                    else:
                        setattr(o, option, int(value))
                    with self.assertRaises(ValueError) as raised:
                        kvwire.Engine(options=o)
                    self.assertEqual(str(raised.exception).split(": ", 1)[1], want)
        self.assertGreaterEqual(rows, 10)

    def test_other_fields(self):
        o = kvwire.EngineOptions()
        o.transport = "tcp"
        self.assertEqual(o.transport, "tcp")
        with self.assertRaisesRegex(ValueError, "unknown transport"):
            o.transport = "pigeon"
        o.shared_secret = b"\x00k"
        self.assertEqual(o.shared_secret, b"\x00k")
        with self.assertRaises(TypeError):
            o.shared_secret = 5
        o.rdma_devices = ["mlx5_0", "mlx5_1:1"]
        self.assertEqual(o.rdma_devices, ["mlx5_0", "mlx5_1:1"])
        o.compat_salt = (1 << 64) - 1
        self.assertEqual(o.compat_salt, (1 << 64) - 1)
        o.shm_cma = True
        o.shm_deny_ptrace = True
        self.assertTrue(o.shm_cma and o.shm_deny_ptrace)

    def test_from_environment_overrides_base_and_ignores_bad_values(self):
        saved = {k: os.environ.get(k) for k in ("KVWIRE_LISTEN", "KVWIRE_TRANSPORT",
                                                "KVWIRE_TCP_CONNECTIONS", "KVWIRE_SHM_CMA")}
        try:
            base = kvwire.EngineOptions()
            base.listen_address = "127.0.0.1:1111"
            base.tcp_connections = 3
            base.shm_cma = True
            os.environ["KVWIRE_LISTEN"] = "127.0.0.1:2222"
            os.environ["KVWIRE_TRANSPORT"] = "carrier-pigeon"
            os.environ["KVWIRE_TCP_CONNECTIONS"] = "65"
            os.environ["KVWIRE_SHM_CMA"] = "yes"
            o = kvwire.EngineOptions.from_environment(base)
            self.assertEqual(o.listen_address, "127.0.0.1:2222")  # set: replaces base
            self.assertEqual(o.transport, "auto")  # bad: ignored
            self.assertEqual(o.tcp_connections, 3)  # out of range: ignored
            self.assertFalse(o.shm_cma)  # anything but "1" turns it off
            self.assertEqual(base.listen_address, "127.0.0.1:1111")  # base is a copy
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class EngineTest(unittest.TestCase):
    def test_two_engines_over_tcp(self):
        opts = kvwire.EngineOptions()
        opts.transport = "tcp"
        opts.tcp_connections = 2
        opts.transfer_timeout_s = 20
        opts.name = "py-opt-a"
        a = kvwire.Engine(options=opts)
        opts.name = "py-opt-b"
        b = kvwire.Engine(options=opts)
        self.assertEqual(a.name, "py-opt-a")
        src, dst = kvwire.Buffer(1 << 20), kvwire.Buffer(1 << 20)
        memoryview(src)[:] = bytes(range(256)) * 4096
        ra = a.register_memory(src)
        rb = b.register_memory(dst, access=3, export_to_all_peers=False)
        with self.assertRaisesRegex(ValueError, "access: 4 is out of range"):
            b.register_memory(dst, access=4)
        inbox = b.open_inbox("py-topic")
        self.assertEqual(inbox.topic, "py-topic")
        peer_b = a.connect(b.address, transport="tcp")
        peer_a = b.wait_for_peer("py-opt-a", timeout_s=10)
        self.assertEqual(a.find_peer("py-opt-b"), peer_b)
        b.export(peer_a, [rb])
        a.wait_for_remote_region(peer_b, rb, timeout_s=10)
        self.assertEqual(a.remote_regions(peer_b), [(rb, 1 << 20)])
        t = a.transfer(peer_b, "write", [(ra, 0, rb, 0, 1 << 20)], notification="done",
                       timeout_s=20)
        deadline = time.monotonic() + 20
        state = ("pending", None)
        while state[0] == "pending" and time.monotonic() < deadline:
            state = a.poll(t)
            time.sleep(0.001)
        self.assertEqual(state, ("succeeded", None))
        self.assertEqual(bytes(memoryview(dst)), bytes(memoryview(src)))
        peer, name, tid, payload = b.wait_notification(timeout_s=10)
        self.assertEqual((peer, name, tid, payload), (peer_a, "py-opt-a", t, b"done"))
        self.assertEqual(b.take_notifications(), [])
        with self.assertRaisesRegex(ValueError, "transfer kind"):
            a.transfer(peer_b, "copy", [(ra, 0, rb, 0, 1)])
        self.assertTrue(any(p["name"] == "py-opt-b" and p["alive"] and "tcp" in p["transport"]
                            for p in a.peers()))
        self.assertIn("py-opt-a", a.stats_prometheus())
        a.send_message(peer_b, "py-topic", b"hi")
        events = inbox.wait(timeout_s=10)
        self.assertEqual(events, [("message", peer_a, "py-opt-a", b"hi")])
        b.unexport(peer_a, [rb])
        # Once the revocation reached a, a refuses the op itself; sent before that, b would
        # drop a as a peer using a region it no longer has (and the disconnect below would
        # carry that reason instead).
        deadline = time.monotonic() + 10
        while a.remote_regions(peer_b) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(a.remote_regions(peer_b), [])
        with self.assertRaises(RuntimeError):
            t = a.transfer(peer_b, "read", [(ra, 0, rb, 0, 16)])
            a.wait(t, 20)
        a.disconnect(peer_b, reason="py test is done")
        deadline = time.monotonic() + 10
        closed = []
        while not closed and time.monotonic() < deadline:
            closed = [e for e in inbox.wait(timeout_s=1) if e[0] == "peer_closed"]
        self.assertTrue(closed and b"py test is done" in closed[0][3])
        a.deregister_memory(ra)
        del a, b


class EtcdServer:
    """A single-member etcd-server on free loopback ports, stopped (and its data removed) by
    stop()."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvwire-py-etcd-")
        self.client = f"http://127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        self.log = open(os.path.join(self.dir, "log"), "w")
        self.proc = subprocess.Popen(
            [ETCD, "--name", "py", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", self.client, "--advertise-client-urls", self.client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"py={peer}", "--log-level", "warn"],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.range("/ready")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("etcd did not start")
                time.sleep(0.05)

    def range(self, prefix):
        key = base64.b64encode(prefix.encode()).decode()
        end = base64.b64encode(prefix[:-1].encode() + bytes([ord(prefix[-1]) + 1])).decode()
        req = urllib.request.Request(f"{self.client}/v3/kv/range",
                                     data=json.dumps({"key": key, "range_end": end}).encode())
        with urllib.request.urlopen(req, timeout=2) as r:
            kvs = json.loads(r.read()).get("kvs", [])
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"]).decode()
                for kv in kvs}

    def stop(self):
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class ConnectorOptionsTest(unittest.TestCase):
    def test_bad_connector_options_are_refused(self):
        for kwargs, message in (({"request_timeout_s": 0}, "request_timeout_s"),
                                ({"handshake_timeout_s": -1}, "handshake_timeout_s"),
                                ({"etcd_call_timeout_s": 601}, "etcd_call_timeout_s"),
                                ({"etcd_lease_seconds": 0}, "etcd_lease_seconds"),
                                ({"etcd_user": "root", "etcd_password": "pw"},
                                 "etcd credentials .* without etcd_endpoints"),
                                ({"etcd_ca_file": "/ca.pem"}, "without etcd_endpoints"),
                                ({"mode": "sideways"}, "mode")):
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(ValueError, message):
                    kvwire.Connector(**kwargs)

    def test_engine_options_and_announce_without_etcd(self):
        opts = kvwire.EngineOptions()
        opts.name = "py-conn-opts"
        opts.transport = "tcp"
        opts.tcp_connections = 1
        c = kvwire.Connector(engine_options=opts, role="prefill", handshake_timeout_s=3)
        self.assertEqual(c.engine_id, "py-conn-opts")
        self.assertEqual(c.engine.name, "py-conn-opts")
        self.assertEqual(c.engine.peers(), [])
        with self.assertRaisesRegex(RuntimeError, "FAILED_PRECONDITION"):
            c.announce()
        self.assertFalse(c.announced)

    def test_announce_registers_in_a_real_etcd_and_destroy_deletes(self):
        if not os.path.exists(ETCD):
            self.fail(f"etcd-server is not installed ({ETCD}); scripts/install-deps.sh installs it")
        etcd = EtcdServer()
        try:
            c = kvwire.Connector(name="py-announce", transport="tcp", etcd_endpoints=etcd.client,
                                 cluster="pytest", etcd_call_timeout_s=2, etcd_lease_seconds=5)
            layout = kvwire.Layout.preset("deepseek-v3")
            size = layout.assign_backing(0, 4)
            mem = kvwire.Buffer(size)
            layout.assign_backing(mem.address, 4)
            c.register_kv_caches(layout, [mem])
            c.announce("127.0.0.1:8000")
            deadline = time.monotonic() + 10
            while not c.announced and time.monotonic() < deadline:
                time.sleep(0.02)
            self.assertTrue(c.announced)
            keys = etcd.range("/kvwire/pytest/")
            self.assertIn("/kvwire/pytest/instances/py-announce", keys)
            record = json.loads(keys["/kvwire/pytest/instances/py-announce"])
            self.assertEqual(record.get("http_address"), "127.0.0.1:8000")
            del c  # a graceful stop deletes the key at once
            self.assertEqual(etcd.range("/kvwire/pytest/"), {})
        finally:
            etcd.stop()


if __name__ == "__main__":
    unittest.main()
