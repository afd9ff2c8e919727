"""kvwire's vLLM connector under vLLM's real classes (make test-vllm; vllm_harness.py).

vLLM's Scheduler, KVConnectorFactory, Request, KVOutputAggregator and
Scheduler.update_from_output decide everything here; kvwire's scheduler-side connector runs in
vLLM's Scheduler, its worker-side connectors in worker processes over host memory.
"""
import socket
import time

import pytest

from vllm_harness import (BS, NUM_BLOCKS, STOP, Engine, decode_params, run_until)

# What a vLLM P/D proxy sends the prefill: do_remote_decode, the other fields null.
PROXY_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prompt(seed, n):
    return [(seed * 131 + i * 7) % 500 + 10 for i in range(n)]


@pytest.fixture
def engines():
    made = []

    def make(*args, **kwargs):
        e = Engine(*args, **kwargs)
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


def prefill_one(p, rid, tokens, stop=None, token=None):
    p.add(rid, tokens, 1, dict(PROXY_PARAMS), stop=stop)
    deadline = time.monotonic() + 20
    while p.finished(rid) is None:
        assert time.monotonic() < deadline, f"prefill {rid} did not finish"
        p.step(**({"token": token} if token is not None else {}))
    return p.finished(rid)


def closed_port():
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_counter(engine, key):
    return sum(int(s.get(key, 0)) for s in engine.worker_stats())


def wait_free(engines_, what, timeout, check=None):
    """Steps every engine until those of `check` (default: all) hold no blocks."""
    check = engines_ if check is None else check
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in engines_:
            e.step()
        if all(e.all_free() for e in check):
            return time.monotonic()
        time.sleep(0.002)
    raise AssertionError(f"{what}: blocks not free within {timeout}s: "
                         f"{[(e.name, e.free_blocks()) for e in check]}")


def test_factory_loads_by_name_and_by_module_path(engines):
    # The plugin entry point registered the name; the module path keeps working.
    e = engines("byname", {"transport": "tcp"}, module_path=None)
    assert type(e.connector).__name__ == "KvwireConnector"
    e2 = engines("bypath", {"transport": "tcp"})
    assert type(e2.connector).__name__ == "KvwireConnector"


@pytest.mark.parametrize("mode,transport,shm", [("read", "tcp", False), ("read", "shm", True)])
def test_hand_off_byte_exact(engines, mode, transport, shm):
    p = engines("prefill", {"transport": transport, "mode": mode}, kind="hybrid",
                shared_memory=shm)
    # policy "fail": a load that fails ends its request in an error instead of being
    # recomputed into the very bytes verify() expects.
    d = engines("decode", {"transport": transport, "mode": mode}, kind="hybrid",
                shared_memory=shm, policy="fail")
    lengths = [1, 15, 16, 17, 40, 100]
    for i, n in enumerate(lengths):
        out = prefill_one(p, f"p{i}", prompt(i, n))
        d.add(f"d{i}", prompt(i, n), 2, decode_params(out))
    running = set()

    def loaded():
        for i in range(len(lengths)):
            rid = f"d{i}"
            if rid not in running and rid in d.sched.requests and \
                    d.sched.requests[rid].num_output_tokens >= 1:
                running.add(rid)
                assert d.verify(rid) == [], rid
        return len(running) == len(lengths)

    run_until([p, d], loaded, "loads")
    # Each prompt longer than one token was loaded by kvwire (a one-token prompt loads
    # nothing: vLLM computes the last prompt token itself), and no load failed.
    assert worker_counter(d, "completed") == sum(n > 1 for n in lengths), d.worker_stats()
    assert worker_counter(d, "failed") == 0, d.worker_stats()
    run_until([p, d], lambda: p.all_free() and d.all_free(), "all blocks free")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_with_two_kv_cache_groups(engines, policy):
    """A load that fails on a model with two KV cache groups ends that request per
    kv_load_failure_policy; vLLM serves the others (today's plugin: RuntimeError in vLLM)."""
    # A short lease: the hand-offs no decode reads come back within seconds.
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": 2}, kind="hybrid")
    d = engines("decode", {"transport": "tcp"}, kind="hybrid", policy=policy)
    good = prefill_one(p, "good", prompt(1, 40))
    gone = decode_params(prefill_one(p, "gone", prompt(2, 40)))
    gone["remote_port"] = closed_port()  # the prefill is gone: the load fails at connect
    malformed = decode_params(prefill_one(p, "malformed", prompt(3, 40)))
    malformed["remote_block_ids"] = "x"  # one malformed field from a client
    d.add("dgood", prompt(1, 40), 3, decode_params(good))
    d.add("dgone", prompt(2, 40), 3, gone)
    d.add("dmalformed", prompt(3, 40), 3, malformed)
    ids = ("dgood", "dgone", "dmalformed")
    run_until([p, d], lambda: all(d.finished(r) is not None for r in ids), "every request")
    assert d.finished("dgood").finish_reason.name == "LENGTH"
    for rid in ("dgone", "dmalformed"):
        if policy == "recompute":
            assert d.finished(rid).finish_reason.name == "LENGTH", rid  # recomputed, served
        else:
            assert d.finished(rid).finish_reason.name == "ERROR", rid  # the client sees it
    # vLLM keeps serving: a new request after the failures.
    d.add("after", prompt(4, 20), 2)
    run_until([p, d], lambda: d.finished("after") is not None, "a request after the failures")
    wait_free([p, d], "all blocks", 15.0)


def test_failed_load_reports_only_its_own_blocks(engines):
    """One KV cache group: a failed load names only the blocks it would have filled, never
    the local prefix blocks it shares with another request."""
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": 2})
    d = engines("decode", {"transport": "tcp"})
    shared = prompt(7, 3 * BS)
    # A decode-local request fills the prefix cache with the shared blocks and keeps running.
    d.add("local", shared + prompt(8, 5), 1000)
    run_until([d], lambda: "local" in d.sched.requests and
              d.sched.requests["local"].num_output_tokens >= 1, "local prefill")
    local_blocks = set(d.sched.kv_cache_manager.get_block_ids("local")[0])
    bad = decode_params(prefill_one(p, "pbad", shared + prompt(9, 2 * BS)))
    bad["remote_port"] = closed_port()  # the prefill is gone: the load fails at connect
    reported = []
    orig = d.sched._handle_invalid_blocks

    def spy(invalid, num_scheduled):
        reported.append(set(invalid))
        return orig(invalid, num_scheduled)

    d.sched._handle_invalid_blocks = spy
    d.add("dbad", shared + prompt(9, 2 * BS), 2, bad)
    run_until([p, d], lambda: d.finished("dbad") is not None, "the failed load, recomputed")
    assert reported, "the failed load was never reported"
    assert not set().union(*reported) & local_blocks, (reported, local_blocks)
    assert d.finished("dbad").finish_reason.name == "LENGTH"
    assert d.finished("local") is None  # the sharer was never touched
    d.abort("local")
    wait_free([p, d], "all blocks", 15.0)


def test_stopped_at_first_token_hands_off(engines):
    """FINISHED_STOPPED (the prefill's one token is a stop token) hands off as
    FINISHED_LENGTH_CAPPED does."""
    p = engines("prefill", {"transport": "tcp"})
    d = engines("decode", {"transport": "tcp"}, policy="fail")
    out = prefill_one(p, "s", prompt(3, 40), stop=[STOP], token=STOP)
    assert out.finish_reason.name == "STOP"
    params = decode_params(out)
    d.add("ds", prompt(3, 40), 2, params)
    run_until([p, d], lambda: "ds" in d.sched.requests and
              d.sched.requests["ds"].num_output_tokens >= 1, "the load")
    assert d.verify("ds") == []
    assert worker_counter(d, "completed") == 1, d.worker_stats()  # loaded, not recomputed
    run_until([p, d], lambda: p.all_free() and d.all_free(), "all blocks free")


def test_decode_abort_before_scheduling_frees_prefill_at_once(engines):
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": 60})
    d = engines("decode", {"transport": "tcp"})
    params = decode_params(prefill_one(p, "a", prompt(4, 40)))
    p.step()  # the hold reaches the prefill's worker
    assert not p.all_free()
    released = worker_counter(p, "released")
    d.add("da", prompt(4, 40), 2, params)
    d.abort("da")  # before the decode's scheduler ever ran it
    t0 = time.monotonic()
    t1 = wait_free([p, d], "abort before scheduling", 1.0)
    assert t1 - t0 < 1.0
    assert worker_counter(p, "released") == released + 1


def test_decode_with_the_prompt_in_its_prefix_cache_frees_prefill_at_once(engines):
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": 60})
    d = engines("decode", {"transport": "tcp"})
    tokens = prompt(5, 2 * BS + 1)  # every block but the last token's is a prefix hit
    d.add("warm", tokens, 1)
    run_until([d], lambda: d.finished("warm") is not None, "the decode's own prefill")
    params = decode_params(prefill_one(p, "h", tokens))
    p.step()
    assert not p.all_free()
    released = worker_counter(p, "released")
    read_before = worker_counter(d, "completed")
    d.add("dh", tokens, 2, params)
    t0 = time.monotonic()
    wait_free([p, d], "prefix-cache hit", 1.0, check=[p])
    assert time.monotonic() - t0 < 1.0
    assert worker_counter(p, "released") == released + 1
    run_until([d], lambda: d.finished("dh") is not None, "the decode request")
    assert worker_counter(d, "completed") == read_before  # nothing was loaded


@pytest.mark.parametrize("mode", ["read", "write"])
def test_decode_with_a_prefix_loads_only_the_rest(engines, mode):
    p = engines("prefill", {"transport": "tcp", "mode": mode})
    d = engines("decode", {"transport": "tcp", "mode": mode})
    k, total = 2, 5
    tokens = prompt(6, total * BS + 3)
    d.add("warm", tokens[:k * BS] + prompt(60, 4), 1)  # the first k blocks, then other tokens
    run_until([d], lambda: d.finished("warm") is not None, "the decode's own prefill")
    if mode == "read":
        params = decode_params(prefill_one(p, "r", tokens))
        d.add("dr", tokens, 2, params)
    else:
        host, _, port = p.connector._sched.workers[0].address.rpartition(":")
        tid = "ab" * 16
        d.add("dr", tokens, 2, {"do_remote_prefill": True, "mode": "write",
                                 "remote_host": host, "remote_port": int(port),
                                 "transfer_id": tid, "remote_engine_id": "prefill"})
        d.step()
        d.step()
        p.add("r", tokens, 1, {"do_remote_decode": True, "mode": "write", "transfer_id": tid})
    run_until([p, d], lambda: "dr" in d.sched.requests and
              d.sched.requests["dr"].num_output_tokens >= 1, "the load")
    assert d.verify("dr") == []
    blocks = len(range(0, len(tokens), BS))
    page = 2 * BS * 4 * 8 * 2  # K and V of one block of one layer: BS tokens, 4 heads of 8
    stats = d.worker_stats()[0] if mode == "read" else p.worker_stats()[0]
    moved = sum(int(g["bytes"]) for g in stats["groups"].values())
    assert moved == (blocks - k) * 4 * page, (moved, blocks, k)
    run_until([p, d], lambda: p.all_free() and d.all_free(), "all blocks free")


def test_pipeline_parallel_is_refused_at_start():
    from vllm.config import ParallelConfig  # noqa: F401 - the config vLLM validates
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_harness import kv_cache_config, vllm_config
    try:
        cfg = vllm_config("pp", {"transport": "tcp"}, pp=2)
    except Exception as e:  # noqa: BLE001 - vLLM itself may refuse PP on this platform
        pytest.fail(f"vLLM refused the config before the connector saw it: {e}")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER,
                                            kv_cache_config("mha"))


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_prefill_tp2_decode_tp1(engines, kind):
    """Prefill TP 2 -> decode TP 1: the decode reads its heads from both prefill ranks (MHA),
    or the replicated latent cache from one of them (MLA), byte-exact."""
    p = engines("prefill", {"transport": "tcp"}, kind=kind, tp=2)
    d = engines("decode", {"transport": "tcp"}, kind=kind, tp=1)
    for i, n in enumerate([17, 40]):
        out = prefill_one(p, f"t{i}", prompt(20 + i, n))
        assert len(out.kv_transfer_params.get("tp_sources", [])) == 1
        d.add(f"dt{i}", prompt(20 + i, n), 2, decode_params(out))
    run_until([p, d], lambda: all(f"dt{i}" in d.sched.requests and
                                  d.sched.requests[f"dt{i}"].num_output_tokens >= 1
                                  for i in range(2)), "loads")
    for i in range(2):
        assert d.verify(f"dt{i}") == []
    assert worker_counter(d, "completed") == 2
    wait_free([p, d], "all blocks", 10.0)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_decode_tp2_computes_locally_and_frees_the_prefill(engines, kind):
    """Decode TP 2 (more ranks than the prefill) loads nothing yet: vLLM computes the prompt
    on the decode, and the prefill frees its blocks at once."""
    p = engines("prefill", {"transport": "tcp"}, kind=kind, tp=1)
    d = engines("decode", {"transport": "tcp"}, kind=kind, tp=2)
    out = prefill_one(p, "t", prompt(30, 40))
    p.step()
    d.add("dt", prompt(30, 40), 2, decode_params(out))
    wait_free([p, d], "prefill blocks", 1.0, check=[p])
    assert worker_counter(p, "released") == 1
    run_until([p, d], lambda: d.finished("dt") is not None, "the decode request")
    assert worker_counter(d, "completed") == 0
