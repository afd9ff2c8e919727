"""One scheduler half: the vLLM plugin's scheduler side (kvwire.vllm_scheduler) is the native
kvwire.SchedulerHalf behind a converter of vLLM's objects. Given the same requests, the plugin
and a bare SchedulerHalf build the same metadata for the workers; the transfer ids the plugin
hands off are the ones the native half holds; the plugin keeps no request state of its own.

Runs without vLLM (the plugin on its stand-in bases, ctest python_scheduler_half); make
test-vllm runs the same scenario on vLLM's real Request and KVCacheBlocks
(test_vllm_plugin.py). Run: PYTHONPATH=<build>/python:python python3 -m unittest
test_scheduler_half
"""
import json
import types
import unittest

import kvwire
from kvwire.vllm_connector import KvwireConnector, KVConnectorRole, KvwireHandshakeMetadata

BS = 16
LOAD = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "10.0.0.1",
        "remote_port": 5000, "transfer_id": "t1", "remote_block_ids": [[1, 2, 3], [4, 5, 6]]}
BAD = {"do_remote_prefill": True, "remote_block_ids": [[1], [2], [3]]}
WRITE = {"do_remote_decode": True, "mode": "write", "transfer_id": "tw"}
READ = {"do_remote_decode": True, "do_remote_prefill": False, "remote_host": None}


def fake_request(rid, prompt_len, params, status="FINISHED_LENGTH_CAPPED"):
    """The fields of vLLM's Request the scheduler side reads."""
    return types.SimpleNamespace(request_id=rid, num_prompt_tokens=prompt_len,
                                 kv_transfer_params=params, num_computed_tokens=0,
                                 status=types.SimpleNamespace(name=status))


def fake_connector(name, groups=2):
    kvt = types.SimpleNamespace(engine_id=name, kv_connector_extra_config={})
    cfg = types.SimpleNamespace(
        kv_transfer_config=kvt, cache_config=types.SimpleNamespace(block_size=BS),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1,
                                              pipeline_parallel_size=1))
    kv = types.SimpleNamespace(kv_cache_groups=[object() for _ in range(groups)])
    return KvwireConnector(cfg, KVConnectorRole.SCHEDULER, kv)


def step(scheduled=None, new_blocks=None):
    cached = types.SimpleNamespace(req_ids=list(new_blocks or {}),
                                   new_block_ids=list((new_blocks or {}).values()))
    return types.SimpleNamespace(num_scheduled_tokens=dict(scheduled or {}),
                                 scheduled_cached_reqs=cached)


def as_dicts(meta):
    fields = ("loads", "saves", "holds", "finishes", "failed", "releases")
    if isinstance(meta, str):
        meta = json.loads(meta)
        return {f: meta[f] for f in fields}
    return {f: getattr(meta, f) for f in fields}


def scenario(conn, make_request, make_blocks, status_aborted="FINISHED_ABORTED"):
    """Drives the plugin `conn` and a bare SchedulerHalf made with its options through one
    script (decode loads, a prefix hit, bad params, a chunked write-mode save, a read-mode
    hand-off, an abort while loading); returns [(plugin metadata, native metadata)] per step
    and the two hand-offs' params. make_request(rid, prompt_len, params[, status]) and
    make_blocks(per-group lists) build the framework's objects."""
    half = kvwire.SchedulerHalf(conn.engine_id, mode="auto", groups=list(conn._names),
                                block_size=BS, tp_size=1)
    hs = {0: KvwireHandshakeMetadata(conn.engine_id, "10.1.2.3:4567", 0)}
    conn.set_xfer_handshake_metadata(hs)
    half.set_workers({0: (conn.engine_id, "10.1.2.3:4567", "")})
    out, hand_offs = [], []

    def both(rid, prompt_len, params, computed, lists, external=None):
        r = make_request(rid, prompt_len, params)
        got = conn.get_num_new_matched_tokens(r, computed)
        want = tuple(half.get_num_new_matched_tokens(rid, prompt_len, computed,
                                                     json.dumps(params)))
        assert got == want, (rid, got, want)
        n = got[0] if external is None else external
        conn.update_state_after_alloc(r, make_blocks(lists), n)
        half.update_state_after_alloc(rid, prompt_len, 0, json.dumps(params), lists, n)
        return r

    def build(scheduled=None, new_blocks=None):
        plugin = conn.build_connector_meta(step(scheduled, new_blocks))
        native = half.build_connector_meta(dict(scheduled or {}), {}, dict(new_blocks or {}))
        out.append((as_dicts(plugin), as_dicts(native)))

    both("d1", 40, LOAD, 16, [[7, 8, 9], [10, 11, 12]])
    both("d2", 40, LOAD, 39, [[13, 14, 15], [16, 17, 18]])  # prefix hit: a release
    both("d3", 40, BAD, 0, [[19, 20, 21], [22, 23, 24]])  # a failed load
    both("w1", 100, WRITE, 0, [[1, 2, 3, 4], [5, 6, 7, 8]])
    build({"w1": 64})
    build({"w1": 36}, {"w1": [[9, 10], [11, 12]]})
    r1 = make_request("r1", 40, READ)
    got = conn.request_finished_all_groups(r1, ([30, 31, 32], [33, 34, 35]))
    want = half.request_finished("r1", 40, json.dumps(READ), [[30, 31, 32], [33, 34, 35]],
                                 True)
    hand_offs.append((got, (want[0], json.loads(want[1]))))
    d1a = make_request("d1", 40, LOAD, status_aborted)
    assert conn.request_finished_all_groups(d1a, ([7, 8, 9], [10, 11, 12])) == (False, None)
    assert half.request_finished("d1", 40, json.dumps(LOAD), [[7, 8, 9], [10, 11, 12]],
                                 False) == (False, "")
    build()
    return out, hand_offs, half


def check_one_implementation(test, conn, make_request, make_blocks, aborted="FINISHED_ABORTED"):
    # No state of its own: the converter holds its connector and the native half, nothing else.
    test.assertEqual(set(vars(conn._sched)), {"c", "native"})
    test.assertIsInstance(conn._sched.native, kvwire.SchedulerHalf)
    steps, hand_offs, _ = scenario(conn, make_request, make_blocks, aborted)
    (plugin_params_pair, native_pair), = hand_offs
    delay, params = plugin_params_pair
    test.assertTrue(delay)
    # The transfer id handed off is the one the native half holds the blocks under.
    held = conn._sched.state()["holding"]
    test.assertEqual(held["r1"], params["transfer_id"])
    test.assertEqual(len(params["transfer_id"]), 32)
    test.assertNotEqual(params["transfer_id"], native_pair[1]["transfer_id"])  # random each
    tids = {params["transfer_id"]: "<tid>", native_pair[1]["transfer_id"]: "<tid>"}

    def same_ids(x):
        text = json.dumps(x, sort_keys=True)
        for tid, name in tids.items():
            text = text.replace(tid, name)
        return json.loads(text)

    test.assertEqual(same_ids(params), same_ids(native_pair[1]))
    test.assertEqual(len(steps), 3)
    for plugin, native in steps:
        test.assertEqual(same_ids(plugin), same_ids(native))
    first, second, third = (p for p, _ in steps)
    test.assertEqual([e["request_id"] for e in first["loads"]], ["d1"])
    test.assertEqual([e["request_id"] for e in first["releases"]], ["d2"])
    test.assertEqual([e["request_id"] for e in first["failed"]], ["d3"])
    test.assertEqual(first["saves"], [])
    test.assertEqual([e["blocks"] for e in second["saves"]],
                     [{"0": [1, 2, 3, 4, 9, 10], "1": [5, 6, 7, 8, 11, 12]}])
    test.assertEqual([h["transfer_id"] for h in third["holds"]], [held["r1"]])
    test.assertEqual([(f["request_id"], f["aborted"]) for f in third["finishes"]],
                     [("d1", True)])


class SchedulerHalfTest(unittest.TestCase):
    def test_plugin_and_native_half_build_the_same_metadata(self):
        def make_request(rid, n, params, status="FINISHED_LENGTH_CAPPED"):
            return fake_request(rid, n, params, status)

        with self.assertLogs("kvwire.vllm", "ERROR") as logs:  # d3's bad params, logged
            check_one_implementation(self, fake_connector("one"), make_request, lambda l: l)
        self.assertIn("bad kv_transfer_params", "\n".join(logs.output))

    def test_workers_come_from_the_native_half(self):
        conn = fake_connector("w")
        conn.set_xfer_handshake_metadata({0: KvwireHandshakeMetadata("w", "h:7", 0, "10.0.0.9")})
        self.assertEqual(conn._sched.native.worker(0), ("w", "h:7", "10.0.0.9"))
        self.assertEqual(conn._sched.workers[0].address, "h:7")
        r = fake_request("r", 20, {"do_remote_decode": True})
        with self.assertLogs("kvwire.vllm", "ERROR") as logs:
            # One flat list for an engine of two groups: no hand-off, the blocks freed.
            self.assertEqual(conn.request_finished(r, [1, 2]), (False, None))
        self.assertIn("1 block lists for 2 KV cache groups", "\n".join(logs.output))
        one = fake_connector("one-group", groups=1)
        one.set_xfer_handshake_metadata({0: KvwireHandshakeMetadata("o", "h:7", 0, "10.0.0.9")})
        delay, params = one.request_finished(r, [1, 2])
        self.assertEqual((delay, params["remote_block_ids"], params["remote_host"]),
                         (True, [1, 2], "10.0.0.9"))


if __name__ == "__main__":
    unittest.main()
