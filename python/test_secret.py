"""The shared secret from Python: Connector(secret=...) and KVWIRE_SECRET really authenticate.
Two connectors (real sockets) move a read-mode request's KV only when their secrets match; a
peer with another secret, or none, gets a failed load that names the secret. Run:
PYTHONPATH=<build>/python:python python3 -m unittest test_secret
"""
import json
import os
import tempfile
import time
import unittest

import kvwire
from kvwire.vllm_connector import Settings

LAYOUT = json.dumps({"model": "toy", "groups": [
    {"name": "full", "layers": [0, 1], "tokens_per_block": 16, "page_bytes": 256,
     "section_row_bytes": [16]}]})
BLOCKS = 8
TOKENS = 40


class Peer:
    def __init__(self, name, secret=None, connector=None, environment=False):
        # environment: the KVWIRE_* environment first (read only when asked for).
        options = kvwire.EngineOptions.from_environment() if environment else None
        self.connector = connector or kvwire.Connector(
            name=name, transport="tcp", request_timeout_s=10.0, secret=secret,
            engine_options=options)
        self.layout = kvwire.Layout.from_json(LAYOUT)
        self.buffer = kvwire.Buffer(self.layout.assign_backing(0, BLOCKS))
        self.view = memoryview(self.buffer)
        self.layout.assign_backing(self.buffer.address, BLOCKS)
        self.connector.register_kv_caches(self.layout, [self.buffer])

    def page(self, layer_index, block):
        g = self.layout.group("full")
        offset = g.block_address(layer_index, block) - self.buffer.address
        return self.view[offset:offset + g.page_bytes]


def transfer(prefill, decode, rid):
    """'' when decode received prefill's bytes intact, else why not."""
    src, dst = [5, 1, 6], [2, 7, 0]
    for layer in range(2):
        for i, (s, d) in enumerate(zip(src, dst)):
            prefill.page(layer, s)[:] = bytes([(17 + 31 * layer + 7 * i) % 256]) * 256
            decode.page(layer, d)[:] = bytes(256)
    p, d = prefill.connector, decode.connector
    p.get_num_new_matched_tokens(rid, TOKENS, 0, json.dumps({"do_remote_decode": True}))
    p.update_state_after_alloc(rid, {"full": src}, 0)
    _, params = p.request_finished(rid, {"full": src}, TOKENS,
                                   json.dumps({"do_remote_decode": True}))
    external, _ = d.get_num_new_matched_tokens(rid, TOKENS, 0, params)
    d.update_state_after_alloc(rid, {"full": dst}, external)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        d.bind_connector_meta(d.build_connector_meta())
        d.start_load_kv()
        _, recving, failed = d.get_finished()
        failed = dict(failed)
        if rid in failed:
            return f"failed load: {failed[rid]}"
        if rid in recving:
            for layer in range(2):
                for s, t in zip(src, dst):
                    if bytes(prefill.page(layer, s)) != bytes(decode.page(layer, t)):
                        return "bytes differ"
            return ""
        time.sleep(0.002)
    return "timed out"


class SecretTest(unittest.TestCase):
    def setUp(self):
        os.environ.pop("KVWIRE_SECRET", None)

    def test_wrong_secret_refused_right_secret_works(self):
        prefill = Peer("py-secret-prefill", secret=b"s3cret\x00bytes")
        self.assertIn("secret", transfer(prefill, Peer("py-secret-wrong", secret="guess"), "w1"))
        self.assertIn("secret", transfer(prefill, Peer("py-secret-none"), "n1"))
        self.assertEqual(transfer(prefill, Peer("py-secret-right", secret=b"s3cret\x00bytes"),
                                  "r1"), "")

    def test_environment_secret(self):
        os.environ["KVWIRE_SECRET"] = "from-the-environment"
        try:
            by_env = Peer("py-env-decode", environment=True)
            overridden = Peer("py-env-override", secret="not-it", environment=True)
            # Without from_environment the variable is not read: no secret.
            unread = Peer("py-env-unread")
        finally:
            os.environ.pop("KVWIRE_SECRET", None)
        prefill = Peer("py-env-prefill", secret="from-the-environment")
        self.assertEqual(transfer(prefill, by_env, "e1"), "")
        self.assertIn("secret", transfer(prefill, overridden, "e2"))
        self.assertIn("secret", transfer(prefill, unread, "e3"))

    def test_vllm_config_secret_file(self):
        with tempfile.TemporaryDirectory() as d:
            def secret_file(name, secret, mode):
                path = os.path.join(d, name)
                with open(path, "wb") as f:
                    f.write(secret + b"\n")
                os.chmod(path, mode)
                return path

            def native(engine_id, path):
                # The vLLM connector's kv_connector_extra_config, as its workers read it.
                s = Settings.from_extra({"transport": "tcp", "secret_file": path})
                return kvwire.Connector(name=engine_id, transport=s.transport, secret=s.secret)

            right = secret_file("right", b"vllm-secret", 0o600)
            prefill = Peer("py-vllm-prefill", secret=b"vllm-secret")
            self.assertEqual(transfer(prefill, Peer("", connector=native("py-vllm-d1", right)),
                                      "v1"), "")
            wrong = secret_file("wrong", b"other", 0o600)
            self.assertIn("secret", transfer(
                prefill, Peer("", connector=native("py-vllm-d2", wrong)), "v2"))
            with self.assertRaisesRegex(ValueError, "chmod 600"):
                native("py-vllm-d3", secret_file("readable", b"vllm-secret", 0o644))

    def test_secret_type_checked(self):
        with self.assertRaises(TypeError):
            kvwire.Connector(name="py-bad-secret", secret=5)


if __name__ == "__main__":
    unittest.main()
