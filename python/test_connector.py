"""Drives the native kvwire.Connector (the pybind11 binding) through its scheduler and worker
calls: a prefill instance and a decode instance (two engines, real sockets), read and write
mode, a failed load, byte-for-byte checks and block accounting. (The vLLM connector class on
top of it has its own test, test_vllm_plugin.) Run: PYTHONPATH=<build>/python:python python3 -m
unittest test_connector
"""
import json
import random
import re
import time
import unittest

import kvwire


class NativeHalf:
    """One instance's kvwire.Connector, called with request objects and per-group block lists
    as a serving engine holds them (both halves of an instance share it)."""

    def __init__(self, native, group_names):
        self.native = native
        self.groups = group_names

    @property
    def address(self):
        return self.native.address

    def _table(self, lists):
        return {g: list(ids) for g, ids in zip(self.groups, lists)}

    @staticmethod
    def _params(request):
        p = request.kv_transfer_params
        return "" if not p else (p if isinstance(p, str) else json.dumps(p))

    def get_num_new_matched_tokens(self, request, computed):
        return self.native.get_num_new_matched_tokens(request.request_id, request.num_tokens,
                                                      computed, self._params(request))

    def update_state_after_alloc(self, request, lists, n):
        self.native.update_state_after_alloc(request.request_id, self._table(lists), n)

    def build_connector_meta(self, _):
        return self.native.build_connector_meta()

    def request_finished(self, request, lists):
        delay, params = self.native.request_finished(request.request_id, self._table(lists),
                                                     request.num_tokens, self._params(request),
                                                     request.aborted)
        return delay, (json.loads(params) if params else None)

    def register_kv_caches(self, layout_and_memory):
        self.native.register_kv_caches(*layout_and_memory)

    def bind_connector_metadata(self, text):
        self.native.bind_connector_meta(text)

    def clear_connector_metadata(self):
        pass

    def start_load_kv(self, _):
        self.native.start_load_kv()

    def save_kv_layer(self, name, *_):
        self.native.save_kv_layer(int(re.findall(r"\d+", name)[0]))

    def wait_for_save(self):
        self.native.wait_for_save()

    def get_finished(self, _):
        sending, recving, failed = self.native.get_finished()
        self.failed = getattr(self, "failed", {})
        self.failed.update(dict(failed))
        recving = set(recving) | {rid for rid, _ in failed}
        return (set(sending) or None), (recving or None)

    def get_failed_loads(self):
        failed, self.failed = getattr(self, "failed", {}), {}
        return failed

    def prometheus(self):
        return self.native.stats_prometheus()

LAYOUT = json.dumps({
    "model": "toy",
    "groups": [
        # section_row_bytes: token-major pages (one row a token), so that read grants can
        # clear the rows of a partly filled block that the request did not fill.
        {"name": "full", "layers": [0, 1, 2, 3], "tokens_per_block": 16, "page_bytes": 512,
         "section_row_bytes": [32]},
        {"name": "swa", "layers": [0, 1, 2, 3], "tokens_per_block": 16, "page_bytes": 256,
         "window_tokens": 32, "section_row_bytes": [16]},
    ],
})
BLOCKS = 32


class Request:
    def __init__(self, request_id, num_tokens, kv_transfer_params=None):
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.kv_transfer_params = kv_transfer_params
        self.aborted = False


class Instance:
    """One vLLM instance: scheduler-side and worker-side connectors plus a block pool."""

    def __init__(self, name, mode="auto", seed=0, as_kv_memory=False):
        self.layout = kvwire.Layout.from_json(LAYOUT)
        native = kvwire.Connector(name=name, mode=mode, transport="tcp")
        self.scheduler = self.worker = NativeHalf(native, [g.name for g in self.layout.groups])
        size = self.layout.assign_backing(0, BLOCKS)
        self.buffer = kvwire.Buffer(size)
        self.view = memoryview(self.buffer)
        self.layout.assign_backing(self.buffer.address, BLOCKS)
        # A kvwire.Buffer, or the same memory as a kvwire.KvMemory range (as a GPU engine
        # passes a tensor's data_ptr(), with kind "gpu").
        memory = (kvwire.KvMemory(self.buffer.address, len(self.buffer), "host")
                  if as_kv_memory else self.buffer)
        self.worker.register_kv_caches((self.layout, [memory]))
        self.rng = random.Random(seed)
        self.free = {g.name: list(range(BLOCKS)) for g in self.layout.groups}
        for ids in self.free.values():
            self.rng.shuffle(ids)  # fragmented
        self.owned = {}

    def allocate(self, request_id, tokens):
        table = []
        for g in self.layout.groups:
            n = (tokens + g.tokens_per_block - 1) // g.tokens_per_block
            table.append([self.free[g.name].pop() for _ in range(n)])
        self.owned[request_id] = table
        return table

    def release(self, request_id):
        for g, ids in zip(self.layout.groups, self.owned.pop(request_id)):
            self.free[g.name].extend(ids)

    def accounting_ok(self):
        for i, g in enumerate(self.layout.groups):
            owned = [b for t in self.owned.values() for b in t[i]]
            if sorted(owned + self.free[g.name]) != list(range(BLOCKS)):
                return False
        return True

    def page(self, group, layer_index, block):
        g = self.layout.group(group)
        offset = g.block_address(layer_index, block) - self.buffer.address
        return self.view[offset:offset + g.page_bytes]

    def step(self):
        """The engine loop's connector calls: metadata to the worker, then get_finished."""
        self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(None))
        self.worker.start_load_kv(None)
        finished = self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        return finished


def pattern(request_id, group, layer, logical, size):
    seed = hash((request_id, group, layer, logical)) & 0xFFFFFFFF
    return random.Random(seed).randbytes(size)


def fill(inst, request_id, table):
    for gi, g in enumerate(inst.layout.groups):
        for li, layer in enumerate(g.layers):
            for logical, block in enumerate(table[gi]):
                inst.page(g.name, li, block)[:] = pattern(request_id, g.name, layer, logical,
                                                           g.page_bytes)


def verify(inst, request_id, table, tokens):
    """The request's tokens' rows (token-major pages): the rest of a partly filled block is
    not the request's (read mode clears it on the prefill before granting it)."""
    for gi, g in enumerate(inst.layout.groups):
        logical_blocks, _, _ = kvwire.select_blocks(g, tokens)
        row = g.page_bytes // g.tokens_per_block
        for li, layer in enumerate(g.layers):
            for logical in logical_blocks:
                n = min(g.tokens_per_block, tokens - logical * g.tokens_per_block) * row
                got = bytes(inst.page(g.name, li, table[gi][logical]))[:n]
                if got != pattern(request_id, g.name, layer, logical, g.page_bytes)[:n]:
                    return f"{request_id} group {g.name} layer {layer} block {logical} differs"
    return ""


def wait_until(predicate, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


class ConnectorTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.prefill = Instance("py-prefill", seed=1)
        cls.decode = Instance("py-decode", seed=2, as_kv_memory=True)

    def load_on_decode(self, request):
        d = self.decode
        n, load_async = d.scheduler.get_num_new_matched_tokens(request, 0)
        self.assertEqual(n, request.num_tokens)
        self.assertTrue(load_async)
        table = d.allocate(request.request_id, request.num_tokens)
        d.scheduler.update_state_after_alloc(request, table, n)
        return table

    def wait_recving(self, request_id):
        def done():
            _, recving = self.decode.step()
            return recving and request_id in recving
        wait_until(done, f"{request_id} received")

    def wait_sending(self, request_id):
        def done():
            sending, _ = self.prefill.step()
            return sending and request_id in sending
        wait_until(done, f"{request_id} sent")

    def test_read_mode(self):
        p, d = self.prefill, self.decode
        for tokens in (1, 31, 32, 33, 200):
            rid = f"read-{tokens}"
            req = Request(rid, tokens, {"do_remote_decode": True})
            self.assertEqual(p.scheduler.get_num_new_matched_tokens(req, 0), (0, False))
            table = p.allocate(rid, tokens)
            p.scheduler.update_state_after_alloc(req, table, 0)
            fill(p, rid, table)
            delay, params = p.scheduler.request_finished(req, table)
            self.assertTrue(delay)
            self.assertEqual(params["mode"], "read")
            dtable = self.load_on_decode(Request(rid, tokens, params))
            self.wait_recving(rid)
            self.assertEqual(verify(d, rid, dtable, tokens), "")
            self.assertEqual(d.worker.get_failed_loads(), {})
            d.release(rid)
            self.wait_sending(rid)
            p.release(rid)
        self.assertTrue(p.accounting_ok() and d.accounting_ok())
        self.assertEqual(p.worker.native.live_requests(), 0)
        self.assertIn("kvwire_connector_group_bytes_total", d.worker.prometheus())

    def test_write_mode_layer_by_layer(self):
        p, d = self.prefill, self.decode
        host, port = p.worker.address.rsplit(":", 1)
        tokens = 150
        rid = "write-1"
        transfer_id = "xfer-write-1"
        dparams = {"do_remote_prefill": True, "remote_host": host, "remote_port": int(port),
                   "transfer_id": transfer_id, "mode": "write", "num_tokens": tokens}
        dtable = self.load_on_decode(Request(rid, tokens, dparams))
        d.step()  # decode's worker sends its block ids
        preq = Request(rid, tokens, {"do_remote_decode": True, "mode": "write",
                                     "transfer_id": transfer_id})
        p.scheduler.get_num_new_matched_tokens(preq, 0)
        table = p.allocate(rid, tokens)
        p.scheduler.update_state_after_alloc(preq, table, 0)
        fill(p, rid, table)
        p.worker.bind_connector_metadata(p.scheduler.build_connector_meta(None))
        for layer in range(4):  # the forward pass: each layer's KV is final in turn
            p.worker.save_kv_layer(f"model.layers.{layer}.self_attn.attn", None, None)
        p.worker.wait_for_save()
        delay, _ = p.scheduler.request_finished(preq, table)
        self.wait_recving(rid)
        self.assertEqual(verify(d, rid, dtable, tokens), "")
        d.release(rid)
        if delay:
            self.wait_sending(rid)
        p.release(rid)
        self.assertTrue(p.accounting_ok() and d.accounting_ok())

    def test_kv_memory_arguments(self):
        m = kvwire.KvMemory(4096, 8192, "gpu", 1)
        self.assertEqual((m.ptr, m.length, m.kind, m.gpu_device), (4096, 8192, "gpu", 1))
        self.assertEqual(kvwire.KvMemory(1, 2).kind, "host")
        with self.assertRaises(ValueError):
            kvwire.KvMemory(1, 2, "tpu")
        with self.assertRaises(TypeError):
            self.decode.worker.native.register_kv_caches(self.decode.layout, ["not memory"])

    def test_vllm_connector_module_imports_without_vllm(self):
        # No vLLM on this test's path: the plugin module still imports, on stand-in bases.
        import kvwire.vllm_connector as vc
        self.assertFalse(vc.HAVE_VLLM)
        self.assertTrue(issubclass(vc.KvwireConnectorMetadata, vc.KVConnectorMetadata))

    def test_failed_load_is_reported_with_reason(self):
        d = self.decode
        with self.assertRaises(ValueError):
            d.scheduler.get_num_new_matched_tokens(Request("bad", 10, "{nope"), 0)
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                  "transfer_id": "nowhere", "mode": "read", "num_tokens": 40,
                  "block_ids": {"full": [0, 1, 2], "swa": [0, 1, 2]}}
        self.load_on_decode(Request("fail-1", 40, params))
        self.wait_recving("fail-1")
        failed = d.worker.get_failed_loads()
        self.assertIn("fail-1", failed)
        self.assertTrue(failed["fail-1"])
        d.release("fail-1")
        self.assertTrue(d.accounting_ok())
        self.assertEqual(d.worker.native.live_requests(), 0)


if __name__ == "__main__":
    unittest.main()
