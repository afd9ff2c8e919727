"""The Python binding's options and the engine surface: kvwire.EngineOptions (every field of
kvwire::EngineOptions, checked by Engine() as C++ and C check them),
EngineOptions.from_environment's precedence, two engines moving bytes over tcp with the new
engine calls, every ConnectorOptions field (checked by Connector() as C++ and C check them),
ConnectorOptions.from_environment, and Connector.announce() against a real etcd-server started
by the test."""
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


def bad_option_rows(name):
    """The rows (option, kind, value, message) of tests/support/<name>, the table the C++ and C
    tests read too."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support",
                        name)
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            yield line.rstrip("\n").split("\t")


class EngineOptionsTest(unittest.TestCase):
    def test_defaults_are_the_cpp_defaults(self):
        o = kvwire.EngineOptions()
        self.assertEqual(o.listen_address, "127.0.0.1:0")
        self.assertEqual(o.transport, "auto")
        self.assertEqual(o.transport_option("tcp", "connections"), "4")
        self.assertEqual(o.transport_option("tcp", "io_poll"), "20us")
        self.assertEqual(o.max_op_bytes, 1 << 20)
        self.assertEqual(o.peer_lease_s, 5.0)
        self.assertEqual(o.heartbeat_interval_s, 0.5)
        self.assertEqual(o.transport_option("rdma", "gid_index"), "-1")
        self.assertEqual(o.shared_secret, b"")
        self.assertEqual(o.transport_option("shm", "cma"), "0")
        self.assertEqual(o.transports, ["rdma", "shm", "tcp"])
        self.assertFalse(o.verify_checksums)

    def refused(self, name, value, pattern):
        """Sets one option; the setter (when the field's type cannot hold the value) or
        Engine() (Engine::Create's one validator) refuses it with ValueError matching pattern."""
        o = kvwire.EngineOptions()
        with self.assertRaisesRegex(ValueError, pattern):
            setattr(o, name, value)
            kvwire.Engine(options=o)

    def test_every_numeric_field_takes_its_range_and_refuses_beyond(self):
        ranges = {
            "max_op_bytes": (1, 64 << 20),
            "stripe_min_bytes": (0, 1 << 40), "max_frame_bytes": (4096, 1 << 30),
            "io_threads": (1, 64), "max_message_bytes": (1, 1 << 30),
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
                     "transfer_timeout_s"):
            with self.subTest(name=name):
                setattr(o, name, 1.5)
                self.assertAlmostEqual(getattr(o, name), 1.5)
                for bad in (0, -1, float("nan"), 1e9):
                    self.refused(name, bad, name[:-2])

    def test_shared_table_of_bad_values(self):
        """tests/support/bad_engine_options.tsv: the same message as C++ and C give."""
        rows = 0
        for option, kind, value, want in bad_option_rows("bad_engine_options.tsv"):
            rows += 1
            with self.subTest(option=option, value=value):
                o = kvwire.EngineOptions()
                with self.assertRaises(ValueError) as raised:
                    # The setter (text that does not parse, an unknown name) or
                    # Engine() (Engine::Create's validator) refuses it.
                    if kind == "ms":
                        setattr(o, option + "_s", int(value) / 1000)
                    elif kind == "text":
                        transport, key = option.split(".", 1)
                        o.set_transport_option(transport, key, value)
                    elif kind == "name":
                        o.transport = value
                    else:
                        setattr(o, option, int(value))
                    kvwire.Engine(options=o)
                self.assertEqual(str(raised.exception).split(": ", 1)[1], want)
        self.assertGreaterEqual(rows, 10)

    def test_other_fields(self):
        o = kvwire.EngineOptions()
        o.transport = "tcp"
        self.assertEqual(o.transport, "tcp")
        o.transport = "pigeon"  # any name here; Engine() checks it
        with self.assertRaisesRegex(ValueError, 'transport: unknown transport "pigeon"'):
            kvwire.Engine(options=o)
        o.transport = "tcp"
        o.shared_secret = b"\x00k"
        self.assertEqual(o.shared_secret, b"\x00k")
        with self.assertRaises(TypeError):
            o.shared_secret = 5
        o.set_transport_option("rdma", "devices", ["mlx5_0", "mlx5_1:1"])
        self.assertEqual(o.transport_option("rdma", "devices"), "mlx5_0,mlx5_1:1")
        o.set_transport_option("tcp", "io_poll", "50us")
        self.assertEqual(o.transport_option("tcp", "io_poll"), "50us")
        o.set_transport_option("tcp", "io_threads", 2)
        self.assertEqual(o.transport_option("tcp", "io_threads"), "2")
        self.assertIn("io_poll", o.transport_option_keys("tcp"))
        with self.assertRaisesRegex(ValueError, 'unknown option "speed" of transport tcp'):
            o.set_transport_option("tcp", "speed", 1)
        o.compat_salt = (1 << 64) - 1
        self.assertEqual(o.compat_salt, (1 << 64) - 1)
        o.set_transport_option("shm", "cma", True)
        o.set_transport_option("shm", "deny_ptrace", True)
        self.assertEqual(o.transport_option("shm", "cma"), "1")
        with self.assertRaisesRegex(ValueError, "shm.cma and shm.deny_ptrace cannot be combined"):
            kvwire.Engine(options=o)

    def test_from_environment_overrides_base_and_refuses_bad_values(self):
        saved = {k: os.environ.get(k) for k in ("KVWIRE_LISTEN", "KVWIRE_TRANSPORT",
                                                "KVWIRE_TCP_CONNECTIONS", "KVWIRE_SHM_CMA",
                                                "KVWIRE_TCP_IO_POLL")}
        try:
            base = kvwire.EngineOptions()
            base.listen_address = "127.0.0.1:1111"
            base.set_transport_option("tcp", "connections", 3)
            os.environ["KVWIRE_LISTEN"] = "127.0.0.1:2222"
            os.environ["KVWIRE_TRANSPORT"] = "tcp"
            os.environ["KVWIRE_TCP_IO_POLL"] = "40us"
            os.environ["KVWIRE_SHM_CMA"] = ""
            o = kvwire.EngineOptions.from_environment(base)
            self.assertEqual(o.listen_address, "127.0.0.1:2222")  # set: replaces base
            self.assertEqual(o.transport, "tcp")
            self.assertEqual(o.transport_option("tcp", "io_poll"), "40us")
            self.assertEqual(o.transport_option("tcp", "connections"), "3")  # unset: base's
            self.assertEqual(o.transport_option("shm", "cma"), "0")  # empty: base's
            self.assertEqual(base.listen_address, "127.0.0.1:1111")  # base is a copy
            # A bad value raises, naming the variable, as C++ and C report it.
            os.environ["KVWIRE_TCP_CONNECTIONS"] = "65"
            with self.assertRaisesRegex(
                    ValueError,
                    r"KVWIRE_TCP_CONNECTIONS=65: tcp.connections: 65 is out of range \(1..64\)"):
                kvwire.EngineOptions.from_environment(base)
            os.environ["KVWIRE_TCP_CONNECTIONS"] = ""
            os.environ["KVWIRE_SHM_CMA"] = "yes"
            with self.assertRaisesRegex(ValueError, 'KVWIRE_SHM_CMA=yes: shm.cma: "yes" is not'):
                kvwire.EngineOptions.from_environment(base)
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
        opts.set_transport_option("tcp", "connections", 2)
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
    def test_shared_table_of_bad_values(self):
        """tests/support/bad_connector_options.tsv: the same message as C++ and C give, from
        Connector() (Connector::Create's validator) or ConnectorOptions.from_environment."""
        rows = 0
        for option, kind, value, want in bad_option_rows("bad_connector_options.tsv"):
            rows += 1
            with self.subTest(option=option, value=value):
                o = kvwire.ConnectorOptions()
                with self.assertRaises(ValueError) as raised:
                    if kind == "env":
                        saved = os.environ.get(option)
                        os.environ[option] = value
                        try:
                            kvwire.ConnectorOptions.from_environment()
                        finally:
                            if saved is None:
                                os.environ.pop(option)
                            else:
                                os.environ[option] = saved
                    else:
                        if kind == "ms":
                            setattr(o, option + "_s", int(value) / 1000)
                        elif kind == "int":
                            setattr(o, option, int(value))
                        elif kind == "transport":
                            transport, key = option.split(".", 1)
                            o.engine.set_transport_option(transport, key, value)
                        else:
                            self.assertEqual(kind, "text")
                            setattr(o, option, value)
                        kvwire.Connector(options=o)
                self.assertEqual(str(raised.exception).split(": ", 1)[1], want)
        self.assertGreaterEqual(rows, 10)

    def test_keywords_go_through_the_same_validator(self):
        for kwargs, message in (
                ({"request_timeout_s": 0}, r"request_timeout: 0 is out of range \(1ms..24h\)"),
                ({"handshake_timeout_s": -1}, r"handshake_timeout: -1s is out of range"),
                ({"etcd_call_timeout_s": 601}, r"etcd_call_timeout: 10m1s is out of range"),
                ({"etcd_lease_seconds": 0}, r"etcd_lease_seconds: 0 is out of range \(1..86400\)"),
                ({"etcd_user": "root", "etcd_password": "pw"},
                 "etcd_user: set without etcd_endpoints"),
                ({"etcd_ca_file": "/ca.pem"}, "etcd_ca_file: set without etcd_endpoints"),
                ({"role": "sideways"}, "role: \"sideways\" is not a role"),
                ({"request_timeout_s": float("nan")}, "request_timeout_s: not a number"),
                ({"mode": "sideways"}, "mode")):
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(ValueError, message):
                    kvwire.Connector(**kwargs)

    def test_connector_options_fields_and_from_environment(self):
        o = kvwire.ConnectorOptions()
        self.assertEqual((o.role, o.mode, o.request_timeout_s, o.handshake_timeout_s,
                          o.etcd_call_timeout_s, o.etcd_lease_seconds, o.read_grants),
                         ("both", "auto", 60.0, 10.0, 2.0, 10, True))
        o.engine.name = "py-conn-env"  # .engine is the options' own, not a copy
        self.assertEqual(o.engine.name, "py-conn-env")
        names = ("KVWIRE_ETCD_USER", "KVWIRE_ETCD_PASSWORD", "KVWIRE_ETCD_PASSWORD_FILE",
                 "KVWIRE_ETCD_CACERT", "KVWIRE_ETCD_CERT", "KVWIRE_ETCD_KEY",
                 "KVWIRE_TCP_CONNECTIONS")
        saved = {k: os.environ.get(k) for k in names}
        try:
            with tempfile.NamedTemporaryFile("w", suffix=".pw") as pw:
                pw.write("from-file\n")
                pw.flush()
                o.etcd_ca_file = "/base-ca.pem"
                os.environ.update({"KVWIRE_ETCD_USER": "root", "KVWIRE_ETCD_PASSWORD": "",
                                   "KVWIRE_ETCD_PASSWORD_FILE": pw.name,
                                   "KVWIRE_ETCD_CACERT": "", "KVWIRE_ETCD_CERT": "/c.pem",
                                   "KVWIRE_ETCD_KEY": "/c.key", "KVWIRE_TCP_CONNECTIONS": "5"})
                got = kvwire.ConnectorOptions.from_environment(o)
            self.assertEqual((got.etcd_user, got.etcd_password, got.etcd_ca_file,
                              got.etcd_cert_file, got.etcd_key_file),
                             ("root", "from-file", "/base-ca.pem", "/c.pem", "/c.key"))
            self.assertEqual(got.engine.name, "py-conn-env")
            self.assertEqual(got.engine.transport_option("tcp", "connections"), "5")
            self.assertEqual(o.etcd_user, "")  # base is a copy
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def test_engine_options_and_announce_without_etcd(self):
        opts = kvwire.EngineOptions()
        opts.name = "py-conn-opts"
        opts.transport = "tcp"
        opts.set_transport_option("tcp", "connections", 1)
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
