"""kvwire's vLLM connector against vLLM's real types, one call at a time, in one process (make
test-vllm runs it in the venv with vLLM from PyPI): the class against vLLM's interface, its
settings, the layouts it derives from torch tensors, kv_transfer_params in vLLM's names, which
finish reasons hand off, and parameters that must fail a load without raising.

Prefill and decode engines in processes, under vLLM's own Scheduler, are test_vllm_real.py's
(vllm_harness.py).

Run: make test-vllm (PYTHONPATH=<build>/python:python, vLLM installed)
"""
import json
import random
import time
import types
import unittest

import torch

import kvwire
from kvwire.vllm_connector import (KvwireConnector, KvwireConnectorMetadata,
                                   KvwireHandshakeMetadata, Settings)
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import (KVConnectorBase_V1,
                                                          KVConnectorRole, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.kv_cache_manager import KVCacheBlock, KVCacheBlocks
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        KVCacheTensor, MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput
from vllm import SamplingParams
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus


def Request(rid, prompt, max_tokens=16, kv_transfer_params=None):  # noqa: N802
    """vLLM's Request with kv_transfer_params as vLLM's engine sets them."""
    r = VllmRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens), None)
    r.kv_transfer_params = kv_transfer_params
    return r

BS = 16  # tokens per block
HEADS, HEAD = 2, 8
NUM_BLOCKS = 48
WINDOW = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn",
          "model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"]
FULL_LAYERS, SWA_LAYERS = LAYERS[0::2], LAYERS[1::2]  # vLLM's hybrid grouping


def kv_cache_config(tp_size=1):
    """vLLM's specs hold a rank's own heads (num_kv_heads / tp_size)."""
    heads = HEADS // tp_size
    full = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD,
                             dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD,
                            dtype=torch.float16, sliding_window=WINDOW)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=NUM_BLOCKS * full.page_size_bytes, layers=[n],
                                        layer_stride=NUM_BLOCKS * full.page_size_bytes,
                                        block_stride=full.page_size_bytes)
                          for n in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(FULL_LAYERS, full), KVCacheGroupSpec(SWA_LAYERS, swa)])


def vllm_config(name, extra, role="kv_both", tp_size=1):
    return VllmConfig(cache_config=CacheConfig(block_size=BS),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="KvwireConnector", engine_id=name, kv_role=role,
                          kv_connector_module_path="kvwire.vllm_connector",
                          kv_connector_extra_config=extra))


def make_caches(shared_memory, heads=HEADS):
    """{layer: tensor}: full layers NHD (2, blocks, BS, H, D) as flash-attn lays them out,
    window layers HND (the same logical shape over permuted strides). Plain torch memory, or
    (shm) torch tensors over a kvwire.Buffer, which a same-host peer can map."""
    elems = 2 * NUM_BLOCKS * BS * heads * HEAD
    keep = []
    if shared_memory:
        buf = kvwire.Buffer(elems * 2 * len(LAYERS))
        keep.append(buf)
        flat = torch.frombuffer(buf, dtype=torch.float16)
    else:
        flat = torch.zeros(elems * len(LAYERS), dtype=torch.float16)
    caches = {}
    for i, name in enumerate(LAYERS):
        part = flat[i * elems:(i + 1) * elems]
        if name in FULL_LAYERS:
            caches[name] = part.view(2, NUM_BLOCKS, BS, heads, HEAD)
        else:
            caches[name] = part.view(2, NUM_BLOCKS, heads, BS, HEAD).permute(0, 1, 3, 2, 4)
    return caches, keep


class PluginUnitTest(unittest.TestCase):
    """In one process: the class against vLLM's interface, settings, layouts."""

    def test_is_a_vllm_connector(self):
        self.assertTrue(issubclass(KvwireConnector, KVConnectorBase_V1))
        self.assertTrue(issubclass(KvwireConnector, SupportsHMA))
        self.assertTrue(issubclass(KvwireConnectorMetadata, KVConnectorMetadata))
        conn = KvwireConnector(vllm_config("unit-s", {}), KVConnectorRole.SCHEDULER,
                               kv_cache_config())  # instantiable: nothing abstract is left
        self.assertIsInstance(conn.build_connector_meta(types.SimpleNamespace()),
                              KVConnectorMetadata)
        self.assertIsNone(conn.native)
        self.assertIsInstance(KvwireConnector.build_kv_connector_stats({"bytes": 3}).reduce(),
                              dict)

    def test_extra_config(self):
        with self.assertRaisesRegex(ValueError, r"unknown .*\['colour'\].*known keys"):
            Settings.from_extra({"colour": "blue"})
        self.assertEqual(Settings.from_extra({"read_mode": "true"}).mode, "read")
        self.assertEqual(Settings.from_extra({"read_mode": False}).mode, "write")
        self.assertEqual(Settings.from_extra({}).mode, "auto")
        with self.assertRaisesRegex(ValueError, "read_mode"):
            Settings.from_extra({"read_mode": True, "mode": "write"})
        with self.assertRaisesRegex(ValueError, "transport"):
            Settings.from_extra({"transport": "carrier-pigeon"})
        with self.assertRaisesRegex(ValueError, r"groups\[0\]"):
            Settings.from_extra({"groups": [{"nmae": "x"}]})
        with self.assertRaisesRegex(ValueError, r"groups\[0\].section_row_bytes"):
            Settings.from_extra({"groups": [{"name": "x", "section_row_bytes": [576, 0]}]})
        self.assertTrue(Settings.from_extra({}).read_grants)
        self.assertFalse(Settings.from_extra({"read_grants": "false"}).read_grants)
        with self.assertRaisesRegex(ValueError, "read_grants"):
            Settings.from_extra({"read_grants": "sometimes"})

    def test_layouts_from_tensors(self):
        conn = KvwireConnector(vllm_config("unit-w", {"transport": "tcp"}),
                               KVConnectorRole.WORKER, kv_cache_config())
        try:
            caches, _ = make_caches(False)
            conn.register_kv_caches(caches)
            layout = conn._worker.layout
            full, swa = layout.groups
            self.assertEqual((full.name, swa.name), ("0", "1"))
            # NHD and HND pages: placement derived from the head split.
            self.assertEqual((full.section_row_bytes, swa.section_row_bytes), ([], []))
            self.assertEqual((full.layers, swa.layers), ([0, 2], [1, 3]))
            self.assertEqual(full.page_bytes, BS * HEADS * HEAD * 2)
            self.assertEqual((full.components, swa.window_tokens), (2, WINDOW))
            for name, g, li in ((LAYERS[2], full, 1), (LAYERS[3], swa, 1)):
                t = caches[name]
                for block, comp in ((0, 0), (5, 1), (NUM_BLOCKS - 1, 1)):
                    self.assertEqual(g.block_address(li, block, comp), t[comp, block].data_ptr())
            meta = conn.get_handshake_metadata()
            self.assertIsInstance(meta, KvwireHandshakeMetadata)
            self.assertEqual(meta.address, conn.address)
            # A CPU tensor: save_kv_layer records no GPU event.
            conn.save_kv_layer(LAYERS[0], caches[LAYERS[0]], None)
            self.assertEqual(conn._worker.events, [])
        finally:
            conn.shutdown()

    def test_deepseek_v4_groups(self):
        """Cache specs kvwire knows nothing of (here shaped as DeepSeek-V4's): one dense page
        per block; what the spec cannot say (compression, window, state) comes from the
        extra config's "groups". The result matches kvwire's own DeepSeek-V4 groups."""
        import dataclasses
        from vllm.v1.kv_cache_interface import KVCacheSpec

        @dataclasses.dataclass(frozen=True)
        class PagedBytesSpec(KVCacheSpec):  # test data, not a vLLM name
            page_bytes: int

            @property
            def page_size_bytes(self):
                return self.page_bytes

        preset = kvwire.Layout.preset("deepseek-v4-flash")
        want = [preset.group(n) for n in ("swa_kv", "c4a_kv", "c4a_compressor_state")]
        names = {"swa_kv": ["m.layers.2.attn.swa", "m.layers.4.attn.swa"],
                 "c4a_kv": ["m.layers.2.attn.c4a", "m.layers.4.attn.c4a"],
                 "c4a_compressor_state": ["m.layers.2.attn.state", "m.layers.4.attn.state"]}
        cfg = KVCacheConfig(num_blocks=6, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(names[g.name], PagedBytesSpec(block_size=g.tokens_per_block,
                                                           page_bytes=g.page_bytes))
            for g in want])
        extra = {"transport": "tcp", "groups": [
            {"name": "swa_kv", "window_tokens": 128, "section_row_bytes": [576, 8]},
            {"name": "c4a_kv", "tokens_per_entry": 4, "section_row_bytes": [576, 8]},
            {"name": "c4a_compressor_state", "tokens_per_entry": 4, "window_tokens": 8,
             "per_request_state": True}]}
        c = KvwireConnector(vllm_config("unit-v4", extra), KVConnectorRole.WORKER, cfg)
        try:
            caches = {n: torch.zeros(6, g.page_bytes, dtype=torch.uint8)
                      for g in want for n in names[g.name]}
            c.register_kv_caches(caches)
            for got, w in zip(c._worker.layout.groups, want):
                self.assertEqual(
                    (got.name, got.tokens_per_block, got.page_bytes, got.tokens_per_entry,
                     got.window_tokens, got.per_request_state, got.layers,
                     got.section_row_bytes),
                    (w.name, w.tokens_per_block, w.page_bytes, w.tokens_per_entry,
                     w.window_tokens, w.per_request_state, [2, 4], w.section_row_bytes))
        finally:
            c.shutdown()

    def test_metrics_endpoint(self):
        import urllib.request
        c = KvwireConnector(vllm_config("unit-m", {"transport": "tcp",
                                                   "metrics_address": "127.0.0.1:0"}),
                            KVConnectorRole.WORKER, kv_cache_config())
        try:
            addr = c.native.metrics_address
            self.assertTrue(addr)
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
                self.assertIn("kvwire_connector_requests_total", r.read().decode())
        finally:
            c.shutdown()

    def test_layouts_refused_with_reasons(self):
        def register(caches, config=None):
            c = KvwireConnector(vllm_config("unit-r", {"transport": "tcp"}),
                                KVConnectorRole.WORKER, config or kv_cache_config())
            try:
                c.register_kv_caches(caches)
            finally:
                c.shutdown()

        caches, _ = make_caches(False)
        bad = dict(caches)
        wide = torch.zeros(2, NUM_BLOCKS, BS, HEADS, HEAD * 2, dtype=torch.float16)
        bad[LAYERS[0]] = wide[..., :HEAD]  # every page has holes
        with self.assertRaisesRegex(ValueError, "layer 'model.layers.0.*contiguous"):
            register(bad)
        bad = dict(caches)
        bad[LAYERS[2]] = torch.zeros(NUM_BLOCKS, 2, BS, HEADS, HEAD, dtype=torch.float16)
        with self.assertRaisesRegex(ValueError, "model.layers.2.*unlike the group's first"):
            register(bad)
        bad = dict(caches)
        del bad[LAYERS[1]]
        with self.assertRaisesRegex(ValueError, "model.layers.1.*no tensor"):
            register(bad)
        # MLA: one latent vector per token, replicated on every rank.
        mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576,
                               dtype=torch.float16)
        cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["l.0.attn"], mla)])
        c = KvwireConnector(vllm_config("unit-mla", {"transport": "tcp"}),
                            KVConnectorRole.WORKER, cfg)
        try:
            t = torch.zeros(8, BS, 576, dtype=torch.float16)
            c.register_kv_caches({"l.0.attn": t})
            g = c._worker.layout.groups[0]
            self.assertEqual((g.components, g.page_bytes), (1, BS * 576 * 2))
            self.assertEqual(g.block_address(0, 3, 0), t[3].data_ptr())
            self.assertEqual(g.section_row_bytes, [576 * 2])  # one row a token
        finally:
            c.shutdown()

    def test_kv_transfer_params_in_vllm_names(self):
        parse = kvwire.parse_kv_transfer_params
        # What a vLLM proxy sends prefill: nulls everywhere.
        p = json.loads(parse(json.dumps({
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
            "something_new": [1, {"x": None}]})))
        self.assertTrue(p["do_remote_decode"])
        # NIXL's names: remote_request_id stands in for transfer_id; no num_tokens.
        p = json.loads(parse(json.dumps({
            "do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "h",
            "remote_port": 5, "remote_request_id": "r-1", "remote_block_ids": [[1, 2], [3]],
            "tp_size": 2})))
        self.assertEqual((p["transfer_id"], p["remote_engine_id"], p["tp_size"]),
                         ("r-1", "p0", 2))
        self.assertEqual(p["remote_block_ids"], [[1, 2], [3]])
        p = json.loads(parse(json.dumps({
            "do_remote_prefill": True, "remote_host": "h", "remote_port": 5,
            "transfer_id": "t", "remote_block_ids": [4, 5, 6]})))
        self.assertEqual(p["remote_block_ids"], [[4, 5, 6]])
        # kvwire's own names keep working.
        p = json.loads(parse(json.dumps({
            "do_remote_prefill": True, "engine_id": "e", "remote_host": "h", "remote_port": 5,
            "transfer_id": "t", "mode": "read", "num_tokens": 9,
            "block_ids": {"swa_kv": [1]}})))
        self.assertEqual((p["remote_block_ids"], p["remote_engine_id"]), ({"swa_kv": [1]}, "e"))
        for bad in ({"remote_block_ids": [[1], 2]}, {"remote_block_ids": "x"},
                    {"tp_size": 0}, {"do_remote_prefill": True, "remote_host": "h",
                                     "remote_port": 5}):
            with self.assertRaises(ValueError, msg=str(bad)):
                parse(json.dumps(bad))

    def test_hand_off_only_when_length_capped_or_stopped(self):
        sched = KvwireConnector(vllm_config("unit-fin", {}), KVConnectorRole.SCHEDULER,
                                kv_cache_config())
        sched.set_xfer_handshake_metadata(
            {0: KvwireHandshakeMetadata("unit-fin", "10.1.2.3:4567", 0)})
        blocks = ([1, 2, 3], [4, 5, 6])
        for status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            r = Request(f"st-{status.name}", [1] * 40, kv_transfer_params={
                "do_remote_decode": True})
            r.status = status
            self.assertEqual(sched.request_finished_all_groups(r, blocks), (False, None))
        r = Request("capped", [1] * 40, kv_transfer_params={"do_remote_decode": True})
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = sched.request_finished_all_groups(r, blocks)
        self.assertTrue(delay)
        self.assertEqual((params["remote_host"], params["remote_port"]), ("10.1.2.3", 4567))
        self.assertEqual(params["remote_block_ids"], [[1, 2, 3], [4, 5, 6]])
        self.assertEqual((params["remote_engine_id"], params["tp_size"]), ("unit-fin", 1))
        self.assertEqual(len(params["transfer_id"]), 32)  # 128 random bits
        meta = sched.build_connector_meta(types.SimpleNamespace())
        self.assertEqual([h["request_id"] for h in meta.holds], ["capped"])
        # Without the hybrid allocator (one group), vLLM calls request_finished with one
        # flat list; the params carry one flat list, as NIXL's do.
        one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                            kv_cache_groups=[kv_cache_config().kv_cache_groups[0]])
        flat = KvwireConnector(vllm_config("unit-flat", {}), KVConnectorRole.SCHEDULER, one)
        flat.set_xfer_handshake_metadata({0: KvwireHandshakeMetadata("f", "h:1", 0)})
        r = Request("flat", [1] * 20, kv_transfer_params={"do_remote_decode": True})
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = flat.request_finished(r, [7, 8])
        self.assertEqual((delay, params["remote_block_ids"]), (True, [7, 8]))

    def test_write_mode_save_waits_for_the_last_prompt_chunk(self):
        """Chunked prefill: the save reaches the workers with the step that computes the last
        chunk (only then are its layers final), with the blocks allocated since."""
        sched = KvwireConnector(vllm_config("unit-chunk", {}), KVConnectorRole.SCHEDULER,
                                kv_cache_config())
        r = Request("chunked", [1] * 100, kv_transfer_params={
            "do_remote_decode": True, "mode": "write", "transfer_id": "t-chunked"})
        self.assertEqual(sched.get_num_new_matched_tokens(r, 0), (0, False))
        sched.update_state_after_alloc(r, KVCacheBlocks((
            [KVCacheBlock(b) for b in (1, 2, 3, 4)], [KVCacheBlock(b) for b in (5, 6, 7, 8)])), 0)
        none = types.SimpleNamespace(req_ids=[], new_block_ids=[])
        meta = sched.build_connector_meta(types.SimpleNamespace(
            num_scheduled_tokens={"chunked": 64}, scheduled_cached_reqs=none))
        self.assertEqual(meta.saves, [])
        self.assertTrue(sched.has_pending_push_work())
        r.num_computed_tokens = 64
        meta = sched.build_connector_meta(types.SimpleNamespace(
            num_scheduled_tokens={"chunked": 36},
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=["chunked"],
                                                        new_block_ids=[([9, 10], [11, 12])])))
        self.assertEqual([e["blocks"] for e in meta.saves],
                         [{"0": [1, 2, 3, 4, 9, 10], "1": [5, 6, 7, 8, 11, 12]}])
        r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.assertEqual(sched.request_finished_all_groups(r, ([1], [2])), (True, None))

    def test_one_scheduler_half(self):
        """The plugin's scheduler side is the native SchedulerHalf: on vLLM's own Request and
        KVCacheBlocks it builds the metadata a bare SchedulerHalf builds from the same inputs,
        hands off the transfer ids the native half holds, and keeps no state of its own."""
        from test_scheduler_half import check_one_implementation

        def make_request(rid, n, params, status="FINISHED_LENGTH_CAPPED"):
            r = Request(rid, [1] * n, kv_transfer_params=params)
            r.status = RequestStatus[status]
            return r

        def make_blocks(lists):
            return KVCacheBlocks(tuple([KVCacheBlock(b) for b in g] for g in lists))

        conn = KvwireConnector(vllm_config("unit-one", {}), KVConnectorRole.SCHEDULER,
                               kv_cache_config())
        with self.assertLogs("kvwire.vllm", "ERROR"):  # the bad params' load, logged
            check_one_implementation(self, conn, make_request, make_blocks)

    def test_random_params_never_raise(self):
        """Whatever a client puts in kv_transfer_params, the scheduler side answers: a
        remote prefill becomes a load or a failed load (never a request left waiting), and
        request_finished returns."""
        rng = random.Random(7)
        values = [None, True, False, 0, -1, 2**70, 1.5, "", "x", "read", "write", [],
                  [1, 2], [[1], [2]], [[1], "a"], {}, {"0": [1]}, {"a": None}, "127.0.0.1"]
        fields = ["do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_host",
                  "remote_port", "remote_block_ids", "block_ids", "remote_request_id",
                  "transfer_id", "tp_size", "mode", "num_tokens", "tp_sources", "other"]
        sched = KvwireConnector(vllm_config("unit-rand", {}), KVConnectorRole.SCHEDULER,
                                kv_cache_config())
        sched.set_xfer_handshake_metadata({0: KvwireHandshakeMetadata("r", "h:1", 0)})
        with self.assertLogs("kvwire.vllm", "ERROR"):  # the reasons are logged (here: kept)
            self.random_params(sched, rng, values, fields)

    def random_params(self, sched, rng, values, fields):
        for i in range(400):
            params = {f: rng.choice(values) for f in rng.sample(fields, rng.randint(0, 8))}
            if rng.random() < 0.5:
                params["do_remote_prefill"] = True
            r = Request(f"rand-{i}", [1] * rng.randint(1, 60), kv_transfer_params=params)
            n, load_async = sched.get_num_new_matched_tokens(r, 0)
            blocks = KVCacheBlocks(([KVCacheBlock(b) for b in range(4)],
                                    [KVCacheBlock(b) for b in range(4, 8)]))
            sched.update_state_after_alloc(r, blocks, n)
            meta = sched.build_connector_meta(types.SimpleNamespace())
            if load_async:
                ids = [e["request_id"] for e in meta.loads + meta.failed]
                self.assertEqual(ids, [r.request_id], params)
            r.status = rng.choice([RequestStatus.FINISHED_LENGTH_CAPPED,
                                   RequestStatus.FINISHED_ABORTED])
            delay, out = sched.request_finished_all_groups(r, ([1], [2]))
            self.assertIsInstance(delay, bool)

    def test_bad_params_fail_the_load_never_raise(self):
        sched = KvwireConnector(vllm_config("unit-bad", {}), KVConnectorRole.SCHEDULER,
                                kv_cache_config())
        worker = KvwireConnector(vllm_config("unit-bad", {"transport": "tcp"}),
                                 KVConnectorRole.WORKER, kv_cache_config())
        try:
            caches, _ = make_caches(False)
            worker.register_kv_caches(caches)
            for i, params in enumerate((
                    {"do_remote_prefill": True, "remote_host": "h", "remote_port": "five",
                     "transfer_id": "t", "remote_block_ids": [[1], [2]]},
                    {"do_remote_prefill": True, "remote_block_ids": [[1], [2], [3]]},
                    {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                     "transfer_id": "t", "remote_block_ids": [[1, 2, 3], [4, 5, 6]]})):
                r = Request(f"bad-{i}", [1] * 40, kv_transfer_params=params)
                n, load_async = sched.get_num_new_matched_tokens(r, 0)
                self.assertEqual((n, load_async), (40, True))
                blocks = KVCacheBlocks(([KVCacheBlock(b) for b in (10, 11, 12)],
                                        [KVCacheBlock(b) for b in (20, 21, 22)]))
                sched.update_state_after_alloc(r, blocks, n)
                worker.bind_connector_metadata(sched.build_connector_meta(None))
                worker.start_load_kv(None)
                worker.wait_for_save()
                deadline = time.monotonic() + 20
                recving = None
                while not recving and time.monotonic() < deadline:
                    _, recving = worker.get_finished(set())
                    time.sleep(0.005)
                self.assertEqual(recving, {r.request_id})
                self.assertEqual(worker.get_block_ids_with_load_errors(),
                                 {10, 11, 12, 20, 21, 22})
                sched.update_connector_output(KVConnectorOutput(finished_recving=recving))
                worker.clear_connector_metadata()
            # Prefill side: a hand-off asked with nonsense finishes without one, logged.
            sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
            r = Request("bad-p", [1] * 40, kv_transfer_params={"do_remote_decode": "yes?"})
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
            with self.assertLogs("kvwire.vllm", "ERROR") as logs:
                self.assertEqual(sched.request_finished_all_groups(r, ([1, 2, 3], [4, 5, 6])),
                                 (False, None))
            self.assertIn("bad kv_transfer_params", "\n".join(logs.output))
            self.assertEqual(worker.native.live_requests(), 0)
        finally:
            worker.shutdown()


class PluginGpuTest(unittest.TestCase):
    def test_save_kv_layer_records_an_event_on_the_current_stream(self):
        if not torch.cuda.is_available():
            self.skipTest("no CUDA device (torch.cuda.is_available() is False): the GPU path "
                          "of save_kv_layer is not exercised on this machine")
        conn = KvwireConnector(vllm_config("gpu-w", {"transport": "tcp"}),
                               KVConnectorRole.WORKER, kv_cache_config())
        try:
            caches = {n: torch.zeros(2, NUM_BLOCKS, BS, HEADS, HEAD, dtype=torch.float16,
                                     device="cuda") for n in LAYERS}
            conn.register_kv_caches(caches)
            conn._worker.saves_bound = True  # as when the step's metadata carries a save
            torch.cuda.current_stream().synchronize()
            caches[LAYERS[0]].add_(1)  # the "attention kernel" writing layer 0, queued
            conn.save_kv_layer(LAYERS[0], caches[LAYERS[0]], None)
            conn.save_kv_layer(LAYERS[1], caches[LAYERS[1]], None)
            # One event per layer, recorded on the current stream behind the writes.
            self.assertEqual(len(conn._worker.events), 2)
            conn.wait_for_save()
            self.assertEqual(conn._worker.events, [])
        finally:
            conn.shutdown()


if __name__ == "__main__":
    unittest.main()
