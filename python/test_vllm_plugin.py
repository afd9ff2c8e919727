"""kvwire's vLLM connector driven the way vLLM drives it, with vLLM's real types (make
test-vllm runs it in the venv with vLLM from PyPI; test_vllm_real.py adds vLLM's own Scheduler).

Each vLLM instance (prefill, decode) is a scheduler in this process and a worker in a process of
its own, as vLLM runs them apart: the scheduler-side connector has no engine and no KV memory
here; the worker-side connector owns real torch CPU tensors registered with kvwire. What the
two sides share crosses the process boundary pickled, as vLLM sends it (the connector
metadata each step, the handshake metadata once, the worker's finished sets back).

MiniEngine below follows vLLM's own sequence (vllm/v1/core/sched/scheduler.py and
vllm/v1/worker/kv_connector_model_runner_mixin.py): get_num_new_matched_tokens ->
allocate -> update_state_after_alloc -> build_connector_meta -> (worker) bind ->
start_load_kv -> per layer wait_for_layer_load / compute / save_kv_layer -> wait_for_save ->
get_finished(finished_req_ids) -> get_block_ids_with_load_errors -> get_kv_connector_stats ->
clear -> (scheduler) invalid blocks -> request_finished_all_groups -> update_connector_output
-> free on finished_sending / finished_recving; aborts as finish_requests does them.

Run: make test-vllm (PYTHONPATH=<build>/python:python, vLLM installed)
"""
import hashlib
import json
import multiprocessing
import os
import random
import signal
import time
import traceback
import types
import unittest

import torch

import kvwire
from kvwire.vllm_connector import (KvwireConnector, KvwireConnectorMetadata,
                                   KvwireHandshakeMetadata, Settings)
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase
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

from vllm_harness import _free_port, _init_tp


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
DEADLINE_S = 40.0


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


def page_pattern(prompt_seed, layer, logical, comp):
    """The KV a prefill computes for one page (the same on any engine for the same prompt)."""
    digest = hashlib.sha256(f"{prompt_seed}/{layer}/{logical}/{comp}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(BS, HEADS, HEAD, generator=g).to(torch.float16)


def cdiv(a, b):
    return (a + b - 1) // b


# ---------------------------------------------------------------------------------------------
# Worker process: vLLM's worker with its model runner's connector calls.
# ---------------------------------------------------------------------------------------------
def worker_main(pipe, name, extra, shared_memory, tp_rank=0, tp_size=1, port=0):
    import logging
    logging.basicConfig(level=logging.ERROR)
    try:
        if tp_size > 1:  # vLLM's own TP group (gloo on loopback), as its worker init makes
            _init_tp(vllm_config(name, extra, tp_size=tp_size), tp_rank, tp_size, port)
        caches, keep = make_caches(shared_memory, HEADS // tp_size)
        conn = KvwireConnector(vllm_config(name, extra, tp_size=tp_size),
                               KVConnectorRole.WORKER, kv_cache_config(tp_size))
        assert isinstance(conn, KVConnectorBase)  # vLLM's model runner checks this
        conn.register_kv_caches(caches)
        pipe.send(("ok", conn.get_handshake_metadata()))
    except Exception:  # noqa: BLE001 - reported to the test
        pipe.send(("error", traceback.format_exc()))
        return
    layout = conn._worker.layout
    while True:
        try:
            cmd, arg = pipe.recv()
        except EOFError:
            return
        try:
            if cmd == "step":
                pipe.send(("ok", worker_step(conn, caches, layout, arg, tp_rank, tp_size)))
            elif cmd == "live":
                pipe.send(("ok", conn.native.live_requests()))
            elif cmd == "peers":
                pipe.send(("ok", json.loads(conn.native.engine_stats_json())["peers"]))
            elif cmd == "stop":
                conn.shutdown()
                pipe.send(("ok", None))
                return
        except Exception:  # noqa: BLE001
            pipe.send(("error", traceback.format_exc()))


def worker_step(conn, caches, layout, arg, tp_rank=0, tp_size=1):
    """execute_model with the connector (KVConnectorModelRunnerMixin's order)."""
    meta, compute, verify, finished_req_ids = arg
    assert isinstance(meta, KVConnectorMetadata)
    mismatches = []
    heads = slice(tp_rank * HEADS // tp_size, (tp_rank + 1) * HEADS // tp_size)
    for rid, table, seed, tokens in verify:  # the KV a successful load put in place
        mismatches += verify_kv(caches, layout, rid, table, seed, tokens, heads)
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    for name in LAYERS:  # the forward pass
        conn.wait_for_layer_load(name)
        gi = 0 if name in FULL_LAYERS else 1
        t = caches[name]
        for rid, table, seed, tokens in compute:
            for logical in range(cdiv(tokens, BS)):
                block = table[gi][logical]
                for comp in (0, 1):
                    t[comp, block].copy_(page_pattern(seed, name, logical, comp)[:, heads])
        conn.save_kv_layer(name, t, None)
    conn.wait_for_save()
    sending, recving = conn.get_finished(finished_req_ids)
    out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                            invalid_block_ids=conn.get_block_ids_with_load_errors(),
                            kv_connector_stats=conn.get_kv_connector_stats())
    conn.clear_connector_metadata()
    return out, mismatches


def verify_kv(caches, layout, rid, table, seed, tokens, heads):
    bad = []
    for gi, g in enumerate(layout.groups):
        logical_blocks, _, _ = kvwire.select_blocks(g, tokens)
        names = FULL_LAYERS if gi == 0 else SWA_LAYERS
        for name in names:
            for logical in logical_blocks:
                for comp in (0, 1):
                    got = caches[name][comp, table[gi][logical]].contiguous().view(torch.int16)
                    want = page_pattern(seed, name, logical, comp)[:, heads]
                    want = want.contiguous().view(torch.int16)
                    if not torch.equal(got, want):
                        bad.append(f"{rid}: {name} block {logical} comp {comp} differs")
    return bad


class WorkerProc:
    def __init__(self, name, extra, shared_memory, tp_rank=0, tp_size=1, port=0):
        ctx = multiprocessing.get_context("fork")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main,
                                args=(child, name, extra, shared_memory, tp_rank, tp_size, port),
                                daemon=True)
        self.proc.start()
        child.close()
        self.handshake = None

    def call(self, cmd, arg=None, timeout=DEADLINE_S):
        if cmd is not None:
            self.pipe.send((cmd, arg))
        if not self.pipe.poll(timeout):
            raise AssertionError(f"worker did not answer {cmd} within {timeout}s")
        status, value = self.pipe.recv()
        if status != "ok":
            raise AssertionError(f"worker failed:\n{value}")
        return value

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self):
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=20)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


# ---------------------------------------------------------------------------------------------
# Scheduler: vLLM's Scheduler, reduced to what the connector sees.
# ---------------------------------------------------------------------------------------------
class MiniEngine:
    def __init__(self, name, extra, shared_memory=False, seed=0, tp_size=1):
        self.name = name
        self.workers = []
        try:
            port = _free_port()
            for rank in range(tp_size):  # all started first: their TP group meets
                self.workers.append(WorkerProc(name, extra, shared_memory, rank, tp_size, port))
            for w in self.workers:
                w.handshake = w.call(None)
        except BaseException:
            self.stop()
            raise
        self.worker = self.workers[0]
        self.conn = KvwireConnector(vllm_config(name, extra, tp_size=tp_size),
                                    KVConnectorRole.SCHEDULER, kv_cache_config(tp_size))
        assert self.conn.native is None  # no engine, no memory in the scheduler's process
        self.conn.set_xfer_handshake_metadata({w.handshake.tp_rank: w.handshake
                                               for w in self.workers})
        self.counts = {"sending": {}, "recving": {}}  # vLLM's KVOutputAggregator
        self.stats = KvwireConnector.build_kv_connector_stats()
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)  # fragmented allocation
        self.requests = {}
        self.blocks = {}  # request id -> ([group 0 ids], [group 1 ids])
        self.waiting, self.running = [], []
        self.finished_recving_ids, self.failed_recving_ids = set(), set()
        self.finished_req_ids = set()
        self.outputs = {}  # request id -> kv_transfer_params of its output
        self.verify, self.verified = [], {}
        self.recomputed, self.mismatches = set(), []
        self.seeds = {}

    # allocation (one pool for all groups, as vLLM's hybrid allocator)
    def allocate(self, rid, tokens):
        n = cdiv(tokens, BS)
        have = self.blocks.setdefault(rid, ([], []))
        for g in have:
            while len(g) < n:
                g.append(self.free.pop())
        return KVCacheBlocks(tuple([KVCacheBlock(b) for b in g] for g in have))

    def free_blocks(self, rid):
        for g in self.blocks.pop(rid, ([], [])):
            self.free.extend(g)
        self.requests.pop(rid, None)

    def add(self, rid, prompt_len, max_tokens, params, seed):
        r = Request(rid, [7] * prompt_len, max_tokens=max_tokens, kv_transfer_params=params)
        self.requests[rid] = r
        self.seeds[rid] = seed
        self.waiting.append(r)
        return r

    def abort(self, rid):
        """Scheduler.finish_requests(rid, FINISHED_ABORTED)."""
        r = self.requests.get(rid)
        if r is None or r.is_finished():
            return
        delay = False
        if r in self.running:
            self.running.remove(r)
        else:
            self.waiting.remove(r)
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                delay = rid not in self.finished_recving_ids
                self.finished_recving_ids.discard(rid)
                self.failed_recving_ids.discard(rid)
        r.status = RequestStatus.FINISHED_ABORTED
        self.free_request(r, delay)

    def free_request(self, r, delay=False):
        d, params = self.conn.request_finished_all_groups(r, tuple(
            list(g) for g in self.blocks.get(r.request_id, ([], []))))
        self.outputs[r.request_id] = params
        self.finished_req_ids.add(r.request_id)
        if not (delay or d):
            self.free_blocks(r.request_id)

    def schedule(self):
        scheduled, compute = {}, []
        for r in list(self.waiting):
            rid = r.request_id
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if rid not in self.finished_recving_ids:
                    continue
                self.finished_recving_ids.discard(rid)
                if rid in self.failed_recving_ids:  # recompute policy, nothing valid
                    self.failed_recving_ids.discard(rid)
                    self.recomputed.add(rid)
                    self.free_blocks_keep_request(rid)
                    r.num_computed_tokens = 0
                else:
                    n = min(len(self.blocks[rid][0]) * BS, r.num_tokens)
                    r.num_computed_tokens = n - 1 if n == r.num_tokens else n
                    self.verify.append((rid, [list(g) for g in self.blocks[rid]],
                                        self.seeds[rid], r.num_prompt_tokens))
                r.status = RequestStatus.WAITING
            if r.num_computed_tokens == 0:
                ext, load_async = self.conn.get_num_new_matched_tokens(r, 0)
                if load_async:
                    blocks = self.allocate(rid, ext)
                    self.conn.update_state_after_alloc(r, blocks, ext)
                    r.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    continue
                blocks = self.allocate(rid, r.num_tokens)
                self.conn.update_state_after_alloc(r, blocks, 0)
                compute.append((rid, [list(g) for g in self.blocks[rid]], self.seeds[rid],
                                r.num_prompt_tokens))
            else:  # the load is in: vLLM allocates the rest and tells the connector again
                self.conn.update_state_after_alloc(r, self.allocate(rid, r.num_tokens), 0)
            self.waiting.remove(r)
            self.running.append(r)
            r.status = RequestStatus.RUNNING
            scheduled[rid] = r.num_tokens - r.num_computed_tokens
        for r in self.running:
            if r.request_id not in scheduled:
                self.allocate(r.request_id, r.num_tokens + 1)
                scheduled[r.request_id] = 1
        out = types.SimpleNamespace(
            num_scheduled_tokens=scheduled, finished_req_ids=set(self.finished_req_ids),
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[]))
        self.finished_req_ids = set()
        out.kv_connector_metadata = self.conn.build_connector_meta(out)
        for rid, n in scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return out, compute

    def free_blocks_keep_request(self, rid):
        for g in self.blocks.pop(rid, ([], [])):
            self.free.extend(g)

    def step(self):
        out, compute = self.schedule()
        verify, self.verify = self.verify, []
        arg = (out.kv_connector_metadata, compute, verify, out.finished_req_ids)
        for w in self.workers:  # every rank gets the same scheduler output
            w.pipe.send(("step", arg))
        results = [w.call(None) for w in self.workers]
        result = self.aggregate([r for r, _ in results])
        mismatches = [m for _, ms in results for m in ms]
        self.mismatches += mismatches
        for rid, *_ in verify:
            self.verified[rid] = not [m for m in mismatches if m.startswith(rid + ":")]
        self.update_from_output(out, result)

    def aggregate(self, outputs):
        """A request is finished sending / receiving once every rank said so."""
        merged = KVConnectorOutput(finished_sending=set(), finished_recving=set())
        for kind, field in (("sending", "finished_sending"), ("recving", "finished_recving")):
            for o in outputs:
                for rid in getattr(o, field) or ():
                    self.counts[kind][rid] = self.counts[kind].get(rid, 0) + 1
                    if self.counts[kind][rid] == len(self.workers):
                        del self.counts[kind][rid]
                        getattr(merged, field).add(rid)
        for o in outputs:
            merged.invalid_block_ids |= o.invalid_block_ids
            if o.kv_connector_stats is not None:  # as vLLM's aggregator and logger use them
                self.stats.aggregate(o.kv_connector_stats)
        return merged

    def update_from_output(self, out, kv):
        if kv.invalid_block_ids:  # _handle_invalid_blocks, policy "recompute"
            for r in self.waiting:
                if (r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and
                        set(self.blocks[r.request_id][0] + self.blocks[r.request_id][1])
                        & kv.invalid_block_ids):
                    self.failed_recving_ids.add(r.request_id)
        for r in list(self.running):
            if r.request_id not in out.num_scheduled_tokens:
                continue
            r.append_output_token_ids(1)
            if len(r.output_token_ids) >= r.max_tokens:
                self.running.remove(r)
                r.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self.free_request(r)
        self.conn.update_connector_output(kv)
        for rid in kv.finished_recving or ():
            r = self.requests[rid]
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_ids.add(rid)
            else:
                assert r.is_finished(), (rid, r.status)
                self.free_blocks(rid)
        for rid in kv.finished_sending or ():
            assert rid in self.requests, rid
            self.free_blocks(rid)

    def idle(self):
        return not self.requests

    def accounting_ok(self):
        return sorted(self.free) == list(range(NUM_BLOCKS)) and not self.blocks

    def stop(self):
        for w in self.workers:
            w.stop()


def run_until(engines, done, what, timeout=DEADLINE_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in engines:
            e.step()
        if done():
            return
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


LENGTHS = [1, 15, 16, 17, 40, 100]


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

    def test_layouts_from_tensors(self):
        conn = KvwireConnector(vllm_config("unit-w", {"transport": "tcp"}),
                               KVConnectorRole.WORKER, kv_cache_config())
        try:
            caches, _ = make_caches(False)
            conn.register_kv_caches(caches)
            layout = conn._worker.layout
            full, swa = layout.groups
            self.assertEqual((full.name, swa.name), ("0", "1"))
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
            {"name": "swa_kv", "window_tokens": 128},
            {"name": "c4a_kv", "tokens_per_entry": 4},
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
                     got.window_tokens, got.per_request_state, got.layers),
                    (w.name, w.tokens_per_block, w.page_bytes, w.tokens_per_entry,
                     w.window_tokens, w.per_request_state, [2, 4]))
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


class PluginProcessesTest(unittest.TestCase):
    """Prefill and decode instances, scheduler and worker apart, concurrent requests."""

    def pair(self, transport, mode, shm_memory, prefill_extra=None, prefill_tp=1):
        extra = {"transport": transport, "mode": mode}
        p = MiniEngine("prefill", dict(extra, **(prefill_extra or {})), shm_memory, seed=1,
                       tp_size=prefill_tp)
        try:
            d = MiniEngine("decode", extra, shm_memory, seed=2)
        except BaseException:
            p.stop()
            raise
        self.addCleanup(d.stop)
        self.addCleanup(p.stop)
        return p, d

    def check_clean(self, *engines):
        for e in engines:
            self.assertTrue(e.accounting_ok(), f"{e.name}: blocks {e.blocks} free {e.free}")
            for w in e.workers:
                self.assertEqual(w.call("live"), 0, e.name)

    def check_transport(self, engine, transport, field):
        """The peer of `engine` moved bytes over `transport` (never a silent fallback)."""
        moved = [p for p in engine.worker.call("peers") if p[field] > 0]
        self.assertTrue(moved, engine.name)
        for p in moved:
            self.assertEqual(p["transport"].split()[0], transport, p)

    def read_mode(self, transport, shm_memory, prefill_tp=1):
        p, d = self.pair(transport, "read", shm_memory, prefill_tp=prefill_tp)
        for i, n in enumerate(LENGTHS):
            # What a vLLM proxy sends prefill: do_remote_decode, the other fields null.
            p.add(f"r{i}", n, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                  "remote_engine_id": None, "remote_block_ids": None,
                                  "remote_host": None, "remote_port": None}, seed=f"s{i}")
        handed = set()

        def proxy():
            for rid, params in list(p.outputs.items()):
                if rid not in handed and params is not None:
                    handed.add(rid)
                    self.assertEqual(params["remote_request_id"], rid)
                    self.assertTrue(params["do_remote_prefill"])
                    self.assertEqual(params["tp_size"], prefill_tp)
                    self.assertEqual(len(params.get("tp_sources", [])), prefill_tp - 1)
                    d.add("d" + rid, LENGTHS[int(rid[1:])], 2, params, seed=f"s{rid[1:]}")
            return len(handed) == len(LENGTHS) and p.idle() and d.idle()

        run_until([p, d], proxy, "read-mode hand-offs")
        self.assertEqual(d.mismatches, [])
        # A one-token prompt loads nothing: vLLM recomputes a prompt's last token anyway.
        self.assertEqual(set(d.verified), {f"dr{i}" for i, n in enumerate(LENGTHS) if n > 1})
        self.assertTrue(all(d.verified.values()))
        self.assertEqual(d.recomputed, set())
        self.check_transport(d, transport, "bytes_read")
        stats = d.stats.reduce()
        self.assertEqual(stats["requests_completed"], sum(n > 1 for n in LENGTHS))
        self.assertGreater(stats["bytes"], 0)
        self.check_clean(p, d)

    def write_mode(self, transport, shm_memory):
        p, d = self.pair(transport, "write", shm_memory)
        host, _, port = p.worker.handshake.address.rpartition(":")
        for i, n in enumerate(LENGTHS):
            tid = f"xfer-{i}-{random.getrandbits(64):x}"
            d.add(f"dw{i}", n, 2, {"do_remote_prefill": True, "mode": "write",
                                   "remote_host": host, "remote_port": int(port),
                                   "transfer_id": tid, "remote_engine_id": "prefill"},
                  seed=f"w{i}")
            p.add(f"w{i}", n, 1, {"do_remote_decode": True, "mode": "write",
                                  "transfer_id": tid}, seed=f"w{i}")
        # Decode allocates and sends its block ids before prefill computes.
        d.step()
        d.step()
        run_until([p, d], lambda: p.idle() and d.idle(), "write-mode hand-offs")
        self.assertEqual(d.mismatches, [])
        self.assertEqual(set(d.verified), {f"dw{i}" for i, n in enumerate(LENGTHS) if n > 1})
        self.assertTrue(all(d.verified.values()))
        self.check_transport(p, transport, "bytes_written")
        self.check_clean(p, d)

    def test_read_tcp(self):
        self.read_mode("tcp", False)

    def test_read_prefill_tp2_decode_tp1(self):
        # Two prefill ranks with half the heads each (vLLM's TP): the hand-off names both,
        # the decode reads its heads from each, every rank frees its blocks.
        self.read_mode("tcp", False, prefill_tp=2)

    def test_read_shm(self):
        self.read_mode("shm", True)

    def test_write_tcp(self):
        self.write_mode("tcp", False)

    def test_write_shm(self):
        self.write_mode("shm", True)

    def test_abort_and_peer_death(self):
        # A short lease, so that blocks held for a decode that died come back in seconds.
        p, d = self.pair("tcp", "read", False, {"request_timeout_s": 5})
        for i, n in enumerate(LENGTHS):
            p.add(f"a{i}", n, 1, {"do_remote_decode": True}, seed=f"a{i}")
        run_until([p], lambda: len(p.outputs) == len(LENGTHS), "prefills")
        params = {rid: v for rid, v in p.outputs.items()}
        # Decode: one request aborted while its KV is on the way, the rest load.
        for rid, v in params.items():
            d.add("d" + rid, LENGTHS[int(rid[1:])], 2, v, seed=f"a{rid[1:]}")
        d.step()  # loads start
        d.abort("da5")
        run_until([p, d], lambda: d.idle() and p.idle(), "loads and the abort")
        self.assertNotIn("da5", d.verified)
        self.assertTrue(all(d.verified.values()))
        self.check_clean(p, d)

        # Prefill dies holding blocks: decode's loads fail, are reported failed (never
        # received), and vLLM recomputes them; decode's blocks all come back.
        for i, n in enumerate(LENGTHS[:3]):
            p.add(f"k{i}", n + 20, 1, {"do_remote_decode": True}, seed=f"k{i}")
        run_until([p], lambda: sum(k.startswith("k") for k in p.outputs) == 3, "prefills")
        p.worker.kill()
        for i in range(3):
            d.add(f"dk{i}", LENGTHS[i] + 20, 2, p.outputs[f"k{i}"], seed=f"k{i}")
        run_until([d], d.idle, "failed loads")
        self.assertEqual(d.recomputed, {"dk0", "dk1", "dk2"})
        self.assertFalse({"dk0", "dk1", "dk2"} & set(d.verified))
        self.check_clean(d)

    def test_reader_done_before_the_hold(self):
        """The prefill's scheduler hands the params out one step before its worker holds the
        blocks; a decode that reads and releases in between still frees them."""
        p, d = self.pair("tcp", "read", False)
        p.add("e0", 40, 1, {"do_remote_decode": True}, seed="e0")
        p.step()  # computed and finished; the hold reaches the worker with the next step
        self.assertIn("e0", p.outputs)
        self.assertEqual(p.worker.call("live"), 0)
        d.add("de0", 40, 2, p.outputs["e0"], seed="e0")
        run_until([d], d.idle, "the load, with the prefill's worker not stepping")
        self.assertEqual(d.verified, {"de0": True})
        run_until([p], p.idle, "the release that came before the hold")
        self.check_clean(p, d)

    def test_decode_death_frees_prefill_blocks(self):
        p, d = self.pair("tcp", "read", False, {"request_timeout_s": 3})
        for i, n in enumerate(LENGTHS[:3]):
            p.add(f"x{i}", n, 1, {"do_remote_decode": True}, seed=f"x{i}")
        run_until([p], lambda: len(p.outputs) == 3, "prefills")
        d.worker.kill()  # the reader never comes: the lease gives the blocks back
        run_until([p], p.idle, "lease expiry", timeout=20)
        self.check_clean(p)


if __name__ == "__main__":
    unittest.main()
