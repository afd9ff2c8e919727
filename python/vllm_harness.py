"""A harness that runs kvwire's vLLM connector under vLLM's own classes, on the CPU.

Each engine (prefill, decode) is vLLM's real Scheduler (vllm.v1.core.sched.scheduler) in this
process, which makes its scheduler-side connector through vLLM's KVConnectorFactory, and one
worker process per tensor-parallel rank, each with a worker-side connector (also made by the
factory) over torch CPU tensors registered with kvwire. What crosses between them is what vLLM
sends: the SchedulerOutput's connector metadata (pickled), the handshake metadata once, and
each worker's KVConnectorOutput, merged by vLLM's own KVOutputAggregator and fed back through
Scheduler.update_from_output as a ModelRunnerOutput.

The "model" writes, for each token a step computes, a page pattern that depends only on the
prompt's tokens up to that page, the layer and K/V: equal on any engine for the same prompt,
so a decode's loaded KV can be compared byte for byte with what its prefill computed.
"""
import hashlib
import json
import multiprocessing
import os
import signal
import socket
import tempfile
import time
import traceback

import torch

import kvwire
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         ParallelConfig, SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.plugins import load_general_plugins
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BS = 16  # tokens per block
HEADS, HEAD = 4, 8  # the model's KV heads (a TP rank holds HEADS / tp of them)
LATENT = 24  # MLA: one latent vector per token, the same on every rank
NUM_BLOCKS = 64
WINDOW = 32
NUM_LAYERS = 4
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
TOKEN = 5  # what the "model" samples
STOP = 9  # a stop token (stop_token_ids)
# Every wait below has a deadline. They are generous (this runs beside compilers on a shared
# 2-core machine): a deadline only bounds a hang, it never measures speed.
DEADLINE_S = 60.0

init_none_hash(sha256)
# What every vLLM process does first: kvwire's entry point (when installed) registers
# KvwireConnector by name.
load_general_plugins()


def _model_dir() -> str:
    """A tiny Llama config (random weights are never loaded: nothing from a model hub)."""
    d = os.path.join(tempfile.gettempdir(), f"kvwire-vllm-model-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": HEADS,
                   "num_key_value_heads": HEADS, "num_hidden_layers": NUM_LAYERS,
                   "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                   "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}, f)
    return d


MODEL_DIR = _model_dir()


def vllm_config(name, extra, *, tp=1, pp=1, policy="recompute",
                module_path="kvwire.vllm_connector"):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = ModelConfig(model=MODEL_DIR, skip_tokenizer_init=True, dtype="float16", seed=0,
                        max_model_len=4096)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096,
                                         max_model_len=4096, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector", kv_connector_module_path=module_path,
            engine_id=name, kv_role="kv_both", kv_load_failure_policy=policy,
            kv_connector_extra_config=extra))


# Groups of each model kind: "mha" one full-attention group; "hybrid" full + sliding window
# (two KV cache groups, as DeepSeek-V4 and every hybrid model has); "mla" one latent group.
def group_layers(kind):
    if kind == "hybrid":
        return [LAYERS[0::2], LAYERS[1::2]]
    return [LAYERS]


def kv_cache_config(kind, tp=1):
    heads = HEADS // tp
    if kind == "mla":
        specs = [MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT,
                                  dtype=torch.float16)]
    else:
        specs = [FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD,
                                   dtype=torch.float16)]
        if kind == "hybrid":
            specs.append(SlidingWindowSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD,
                                           dtype=torch.float16, sliding_window=WINDOW))
    groups = [KVCacheGroupSpec(names, spec) for names, spec in zip(group_layers(kind), specs)]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],  # the workers' tensors are made by make_caches
        kv_cache_groups=groups)


def make_caches(kind, tp, shared_memory):
    """{layer: tensor}: MHA (2, blocks, BS, heads, D) as flash-attn lays it out, except the
    sliding-window layers of "hybrid", HND (the same logical shape over permuted strides, as
    other attention backends lay it out); MLA (blocks, BS, LATENT). Plain torch memory, or
    torch over a kvwire.Buffer (shm), which a same-host peer can map."""
    if kind == "mla":
        per = NUM_BLOCKS * BS * LATENT
    else:
        per = 2 * NUM_BLOCKS * BS * (HEADS // tp) * HEAD
    keep = []
    if shared_memory:
        buf = kvwire.Buffer(per * 2 * NUM_LAYERS)
        keep.append(buf)
        flat = torch.frombuffer(buf, dtype=torch.float16)
    else:
        flat = torch.zeros(per * NUM_LAYERS, dtype=torch.float16)
    caches = {}
    for i, name in enumerate(LAYERS):
        part = flat[i * per:(i + 1) * per]
        if kind == "mla":
            caches[name] = part.view(NUM_BLOCKS, BS, LATENT)
        elif kind == "hybrid" and name in group_layers(kind)[1]:
            caches[name] = part.view(2, NUM_BLOCKS, HEADS // tp, BS, HEAD).permute(0, 1, 3, 2, 4)
        else:
            caches[name] = part.view(2, NUM_BLOCKS, BS, HEADS // tp, HEAD)
    return caches, keep


def page_pattern(kind, prompt, logical, layer, comp):
    """The KV of one page as any engine computes it for this prompt (all heads)."""
    upto = prompt[:(logical + 1) * BS]
    digest = hashlib.sha256(f"{upto}/{layer}/{comp}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    if kind == "mla":
        return torch.randn(BS, LATENT, generator=g).to(torch.float16)
    return torch.randn(BS, HEADS, HEAD, generator=g).to(torch.float16)


def page_of(kind, t, comp, block):
    return t[block] if kind == "mla" else t[comp, block]


def rank_slice(kind, x, tp_rank, tp):
    if kind == "mla":
        return x
    h = HEADS // tp
    return x[:, tp_rank * h:(tp_rank + 1) * h]


# ---------------------------------------------------------------------------------------------
# Worker process: the model runner's connector calls (KVConnectorModelRunnerMixin's order).
# ---------------------------------------------------------------------------------------------
def _init_tp(cfg, rank, tp, port):
    """vLLM's own distributed state for a TP group of worker processes (gloo, loopback)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (init_distributed_environment,
                                                 initialize_model_parallel)
    # vLLM's CPU worker names its group's shared memory after the init port (cpu_worker.py);
    # its CPU communicator reads that name, so a worker made outside vLLM sets it the same way.
    os.environ["VLLM_DIST_IDENT"] = str(port)
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=tp, rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)


def worker_main(pipe, cfg, kind, tp_rank, tp, port, shared_memory):
    import logging
    logging.basicConfig(level=logging.ERROR)
    try:
        if tp > 1:
            _init_tp(cfg, tp_rank, tp, port)
        caches, keep = make_caches(kind, tp, shared_memory)
        conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER,
                                                   kv_cache_config(kind, tp))
        conn.register_kv_caches(caches)
        pipe.send(("ok", conn.get_handshake_metadata()))
    except Exception:  # noqa: BLE001 - reported to the test
        pipe.send(("error", traceback.format_exc()))
        return
    groups = group_layers(kind)
    while True:
        try:
            cmd, arg = pipe.recv()
        except EOFError:
            return
        try:
            if cmd == "step":
                pipe.send(("ok", worker_step(conn, caches, kind, groups, arg, tp_rank, tp)))
            elif cmd == "verify":
                pipe.send(("ok", verify(conn, caches, kind, groups, arg, tp_rank, tp)))
            elif cmd == "stats":
                pipe.send(("ok", conn.stats()))
            elif cmd == "live":  # requests the worker's kvwire.Connector still tracks
                pipe.send(("ok", conn.native.live_requests()))
            elif cmd == "peers":  # per peer: transport, bytes_read, bytes_written
                pipe.send(("ok", json.loads(conn.native.engine_stats_json())["peers"]))
            elif cmd == "moved":  # bytes of completed transfers by the transport that moved them
                pipe.send(("ok", json.loads(conn.native.engine_stats_json())["bytes_by_transport"]))
            elif cmd == "stop":
                conn.shutdown()
                pipe.send(("ok", None))
                return
        except Exception:  # noqa: BLE001
            pipe.send(("error", traceback.format_exc()))


def worker_step(conn, caches, kind, groups, arg, tp_rank, tp):
    meta, compute, finished_req_ids = arg
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    for name in LAYERS:  # the forward pass
        conn.wait_for_layer_load(name)
        gi = next(i for i, g in enumerate(groups) if name in g)
        t = caches[name]
        for rid, block_ids, prompt, start, end in compute:
            for pos in range(start, end):
                logical, row = divmod(pos, BS)
                block = block_ids[gi][logical] if logical < len(block_ids[gi]) else 0
                if block == 0:
                    continue  # vLLM's null block (outside a sliding window)
                for comp in range(1 if kind == "mla" else 2):
                    want = rank_slice(kind, page_pattern(kind, prompt, logical, name, comp),
                                      tp_rank, tp)
                    page_of(kind, t, comp, block)[row].copy_(want[row])
        conn.save_kv_layer(name, t, None)
    conn.wait_for_save()
    results = conn.get_transfer_results(finished_req_ids)
    from vllm.v1.outputs import KVConnectorOutput
    out = KVConnectorOutput(finished_sending=results.finished_sending or None,
                            finished_recving=results.finished_recving or None,
                            failed_recving=results.failed_recving,
                            invalid_block_ids=conn.get_block_ids_with_load_errors(),
                            kv_connector_stats=conn.get_kv_connector_stats())
    conn.clear_connector_metadata()
    return out


def verify(conn, caches, kind, groups, arg, tp_rank, tp):
    """Mismatches between the pages a request holds and what its prefill computed."""
    rid, block_ids, prompt = arg
    layout = conn._worker.layout
    bad = []
    for gi, g in enumerate(layout.groups):
        logical_blocks, _, _ = kvwire.select_blocks(g, len(prompt))
        for name in groups[gi]:
            for logical in logical_blocks:
                rows = min(BS, len(prompt) - logical * BS)
                for comp in range(1 if kind == "mla" else 2):
                    got = page_of(kind, caches[name], comp, block_ids[gi][logical])[:rows]
                    want = rank_slice(kind, page_pattern(kind, prompt, logical, name, comp),
                                      tp_rank, tp)[:rows]
                    if not torch.equal(got.contiguous().view(torch.int16),
                                       want.contiguous().view(torch.int16)):
                        bad.append(f"{rid}: rank {tp_rank} {name} block {logical} comp {comp}")
    return bad


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProc:
    def __init__(self, cfg, kind, tp_rank, tp, port, shared_memory):
        ctx = multiprocessing.get_context("fork")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main,
                                args=(child, cfg, kind, tp_rank, tp, port, shared_memory),
                                daemon=True)
        self.proc.start()
        child.close()

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
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.join(10)


# ---------------------------------------------------------------------------------------------
# An engine: vLLM's Scheduler here, its workers in processes.
# ---------------------------------------------------------------------------------------------
class Engine:
    def __init__(self, name, extra, *, kind="mha", tp=1, policy="recompute",
                 shared_memory=False, module_path="kvwire.vllm_connector"):
        self.name, self.kind, self.tp = name, kind, tp
        self.cfg = vllm_config(name, extra, tp=tp, policy=policy, module_path=module_path)
        self.workers = []
        try:
            port = _free_port()
            for rank in range(tp):
                self.workers.append(WorkerProc(self.cfg, kind, rank, tp, port, shared_memory))
            handshakes = [w.call(None) for w in self.workers]
            self.cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
            self.sched = Scheduler(vllm_config=self.cfg, kv_cache_config=kv_cache_config(kind, tp),
                                   log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.cfg),
                                   block_size=BS)
        except BaseException:
            self.stop()
            raise
        self.connector = self.sched.connector
        # What vLLM's engine core does once its workers report their handshake metadata.
        self.connector.set_xfer_handshake_metadata({h.tp_rank: h for h in handshakes})
        self.aggregator = KVOutputAggregator.from_connector(self.connector, tp)
        self.prompts = {}
        self.outputs = {}  # request id -> [EngineCoreOutput, ...]
        self.kv_stats = []  # aggregated KVConnectorStats, as vLLM's logger gets them

    # requests ---------------------------------------------------------------------------
    def add(self, rid, prompt, max_tokens, params=None, stop=None):
        extra_args = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop or []),
                            extra_args=extra_args)
        req = Request(rid, list(prompt), sp, None,
                      block_hasher=get_request_block_hasher(BS, sha256))
        self.prompts[rid] = list(prompt)
        self.sched.add_request(req)
        return req

    def abort(self, rid):
        from vllm.v1.request import RequestStatus
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def finished(self, rid):
        outs = self.outputs.get(rid, [])
        return next((o for o in outs if o.finish_reason is not None), None)

    # one engine step ----------------------------------------------------------------------
    def step(self, token=TOKEN):
        out = self.sched.schedule()
        compute = []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens  # schedule() advanced it past this step's tokens
            start = end - n
            prompt = self.prompts[rid]
            if start < len(prompt):
                ids = [list(g) for g in self.sched.kv_cache_manager.get_block_ids(rid)]
                compute.append((rid, ids, prompt, start, min(end, len(prompt))))
        arg = (out.kv_connector_metadata, compute, set(out.finished_req_ids))
        for w in self.workers:  # every rank gets the same scheduler output
            w.pipe.send(("step", arg))
        kv_outs = [w.call(None) for w in self.workers]
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([token] if done else [])
        outputs = [ModelRunnerOutput(req_ids=req_ids,
                                     req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                     sampled_token_ids=sampled, kv_connector_output=kv)
                   for kv in kv_outs]
        merged = self.aggregator.aggregate(outputs)
        if merged.kv_connector_output and merged.kv_connector_output.kv_connector_stats:
            self.kv_stats.append(merged.kv_connector_output.kv_connector_stats)
        engine_outputs = self.sched.update_from_output(out, merged)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
        return out

    # checks ---------------------------------------------------------------------------------
    def free_blocks(self):
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def all_free(self):
        return self.free_blocks() == NUM_BLOCKS - 1 and not self.sched.requests

    def verify(self, rid):
        ids = [list(g) for g in self.sched.kv_cache_manager.get_block_ids(rid)]
        bad = []
        for w in self.workers:
            bad += w.call("verify", (rid, ids, self.prompts[rid]))
        return bad

    def worker_stats(self):
        return [w.call("stats") for w in self.workers]

    def live(self):
        return sum(w.call("live") for w in self.workers)

    def peers(self):
        return [p for w in self.workers for p in w.call("peers")]

    def moved(self):
        """{"<transport>_read" | "<transport>_written": bytes} over every worker's engine."""
        out = {}
        for w in self.workers:
            for key, n in w.call("moved").items():
                out[key] = out.get(key, 0) + int(n)
        return out

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


def decode_params(prefill_output):
    """What vLLM's P/D proxy hands the decode: the prefill output's kv_transfer_params."""
    params = dict(prefill_output.kv_transfer_params or {})
    assert params.get("do_remote_prefill"), params
    return params
