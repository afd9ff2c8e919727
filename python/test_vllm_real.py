"""kvwire's vLLM connector under vLLM's real classes (make test-vllm; vllm_harness.py).

vLLM's Scheduler, KVConnectorFactory, Request, KVOutputAggregator and
Scheduler.update_from_output decide everything here; kvwire's scheduler-side connector runs in
vLLM's Scheduler, its worker-side connectors in worker processes over host memory.
"""
import json
import socket
import time

import pytest

from vllm_harness import (BS, DEADLINE_S, NUM_BLOCKS, STOP, Engine, decode_params, run_until)

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
    deadline = time.monotonic() + DEADLINE_S
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


# The prefill's lease in the tests that check a block release that is not the lease's: much
# longer than any deadline here, and the lease_expired counter must stay 0.
LONG_LEASE_S = 600
# A release deadline: far under LONG_LEASE_S, generous for a loaded machine.
RELEASE_DEADLINE_S = 30.0
# The lease where a test waits for it to give hand-offs nobody reads back: long enough that a
# hand-off a test does read is read first on a loaded machine, short enough to wait for.
SHORT_LEASE_S = 10


def run_loads(p, d, rids, what="loads"):
    """Steps both engines until every decode request of `rids` has its first token, checking
    each one's KV byte for byte when it is first seen so: it leaves the scheduler a step or two
    later, maybe before the others load."""
    seen = set()

    def done():
        for rid in rids:
            if rid not in seen and rid in d.sched.requests and \
                    d.sched.requests[rid].num_output_tokens >= 1:
                seen.add(rid)
                assert d.verify(rid) == [], rid
        return len(seen) == len(rids)

    run_until([p, d], done, what)


def check_clean(*engines_):
    """Every block free, and no worker's kvwire.Connector tracks a request any more."""
    for e in engines_:
        assert e.all_free(), (e.name, e.free_blocks(), list(e.sched.requests))
        assert e.live() == 0, e.name


def check_transport(engine, transport, direction):
    """Every byte `engine` moved in `direction` ("read" or "written") went over `transport`:
    counted by the engine per completed transfer, by the transport that carried it (a peer's
    first choice says nothing about a region that its transport cannot reach)."""
    moved = engine.moved()
    assert moved.get(f"{transport}_{direction}", 0) > 0, (engine.name, moved)
    others = {k: n for k, n in moved.items()
              if k.endswith(f"_{direction}") and k != f"{transport}_{direction}" and n > 0}
    assert not others, (engine.name, transport, moved)


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


HAND_OFF_LENGTHS = [1, 15, 16, 17, 40, 100]


def write_mode_params(p, tid):
    """What a P/D proxy sends a write-mode decode: the prefill's kv address and the transfer
    id both sides get."""
    host, _, port = p.connector._sched.workers[0].address.rpartition(":")
    return {"do_remote_prefill": True, "mode": "write", "remote_host": host,
            "remote_port": int(port), "transfer_id": tid, "remote_engine_id": p.name}


# (mode, transport asked for, KV in shareable memory, read_grants, the transport that moves
# the KV). With read grants (the default) the KV regions are readable only under a grant and
# never mapped by a peer, so over "shm" the owner of the KV copies each READ and WRITE itself
# after checking its grant (served copies, transport/shm/served_copy.h); without them shm maps
# the KV and moves it itself. Either way the bytes move over shm, not loopback tcp.
@pytest.mark.parametrize("mode,transport,shm,grants,moved_over", [
    ("read", "tcp", False, True, "tcp"),
    ("read", "shm", True, True, "shm"),
    ("read", "shm", True, False, "shm"),
    ("write", "tcp", False, True, "tcp"),
    ("write", "shm", True, True, "shm"),
    ("write", "shm", True, False, "shm"),
])
def test_hand_off_byte_exact(engines, mode, transport, shm, grants, moved_over):
    """Prompts of 1, 15, 16, 17, 40 and 100 tokens on a two-group model (full attention NHD,
    sliding window HND): the decode's KV equals its prefill's byte for byte, every byte moved
    over the transport that can carry it (counted per transport), and both sides end with every
    block free."""
    # A lease far longer than the deadlines: the one-token prompt's decode loads nothing and
    # tells the prefill so (in write mode before the prefill has even seen that request),
    # which frees those blocks at once, never at the lease.
    p = engines("prefill", {"transport": transport, "mode": mode, "read_grants": grants,
                            "request_timeout_s": LONG_LEASE_S}, kind="hybrid", shared_memory=shm)
    # policy "fail": a load that fails ends its request in an error instead of being
    # recomputed into the very bytes verify() expects.
    d = engines("decode", {"transport": transport, "mode": mode, "read_grants": grants},
                kind="hybrid", shared_memory=shm, policy="fail")
    lengths = HAND_OFF_LENGTHS
    # Four output tokens: a request stays in the decode's scheduler for a few steps after its
    # first token, for run_loads() to see it there and verify its blocks.
    if mode == "read":
        for i, n in enumerate(lengths):
            out = prefill_one(p, f"p{i}", prompt(i, n))
            d.add(f"d{i}", prompt(i, n), 4, decode_params(out))
    else:
        # The decode allocates and sends its block ids before the prefill computes.
        for i, n in enumerate(lengths):
            tid = f"{i:02x}" * 16
            d.add(f"d{i}", prompt(i, n), 4, write_mode_params(p, tid))
            p.add(f"p{i}", prompt(i, n), 1, {"do_remote_decode": True, "mode": "write",
                                             "transfer_id": tid})
        d.step()
        d.step()
    run_loads(p, d, [f"d{i}" for i in range(len(lengths))])
    # Each prompt longer than one token was loaded by kvwire (a one-token prompt loads
    # nothing: vLLM computes the last prompt token itself), and no load failed.
    assert worker_counter(d, "completed") == sum(n > 1 for n in lengths), d.worker_stats()
    assert worker_counter(d, "failed") == 0, d.worker_stats()
    if mode == "read":
        check_transport(d, moved_over, "read")
    else:
        check_transport(p, moved_over, "written")
    run_until([p, d], lambda: p.all_free() and d.all_free(), "all blocks free")
    assert worker_counter(p, "released") == sum(n == 1 for n in lengths), p.worker_stats()
    assert worker_counter(p, "lease_expired") == 0, p.worker_stats()
    check_clean(p, d)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_with_two_kv_cache_groups(engines, policy):
    """A load that fails on a model with two KV cache groups ends that request per
    kv_load_failure_policy; vLLM serves the others (today's plugin: RuntimeError in vLLM)."""
    # A short lease: the hand-offs no decode reads come back within seconds. The one the
    # decode does read is prefilled last, so that the lease never ends it first.
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": SHORT_LEASE_S},
                kind="hybrid")
    d = engines("decode", {"transport": "tcp"}, kind="hybrid", policy=policy)
    gone = decode_params(prefill_one(p, "gone", prompt(2, 40)))
    gone["remote_port"] = closed_port()  # the prefill is gone: the load fails at connect
    malformed = decode_params(prefill_one(p, "malformed", prompt(3, 40)))
    malformed["remote_block_ids"] = "x"  # one malformed field from a client
    good = prefill_one(p, "good", prompt(1, 40))
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
    wait_free([p, d], "all blocks", DEADLINE_S)


def test_failed_load_reports_only_its_own_blocks(engines):
    """One KV cache group: a failed load names only the blocks it would have filled, never
    the local prefix blocks it shares with another request."""
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": SHORT_LEASE_S})
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
    wait_free([p, d], "all blocks", DEADLINE_S)


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
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": LONG_LEASE_S})
    d = engines("decode", {"transport": "tcp"})
    params = decode_params(prefill_one(p, "a", prompt(4, 40)))
    p.step()  # the hold reaches the prefill's worker
    assert not p.all_free()
    released = worker_counter(p, "released")
    d.add("da", prompt(4, 40), 2, params)
    d.abort("da")  # before the decode's scheduler ever ran it
    wait_free([p, d], "abort before scheduling", RELEASE_DEADLINE_S)
    # Freed by the decode's release (not the lease, which is far longer than the deadline).
    assert worker_counter(p, "released") == released + 1
    assert worker_counter(p, "lease_expired") == 0


def test_decode_abort_while_loading(engines):
    """The decode aborts one request after its load started (WAITING_FOR_REMOTE_KVS): vLLM
    frees its blocks only once kvwire reports the load over; the other loads complete
    byte-exact, and both sides end with every block free."""
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": LONG_LEASE_S})
    d = engines("decode", {"transport": "tcp"}, policy="fail")
    lengths = [17, 40, 100]
    for i, n in enumerate(lengths):
        out = prefill_one(p, f"a{i}", prompt(40 + i, n))
        d.add(f"da{i}", prompt(40 + i, n), 2, decode_params(out))
    d.step()  # the loads start
    assert d.sched.requests["da2"].status.name == "WAITING_FOR_REMOTE_KVS"
    d.abort("da2")
    verified = set()

    def done():
        for rid in ("da0", "da1"):
            if rid not in verified and rid in d.sched.requests and \
                    d.sched.requests[rid].num_output_tokens >= 1:
                verified.add(rid)
                assert d.verify(rid) == [], rid
        return len(verified) == 2 and p.all_free() and d.all_free()

    run_until([p, d], done, "the loads and the abort")
    assert worker_counter(p, "lease_expired") == 0
    check_clean(p, d)


def test_prefill_dies_holding_blocks(engines):
    """The prefill's worker dies after its hand-offs went out: the decode's loads fail, are
    reported failed, vLLM recomputes them (policy recompute), and every decode block comes
    back."""
    p = engines("prefill", {"transport": "tcp"})
    # request_timeout_s: the decode's transfer deadline too, should a read hang on the dead peer.
    d = engines("decode", {"transport": "tcp", "request_timeout_s": SHORT_LEASE_S},
                policy="recompute")
    outs = [prefill_one(p, f"k{i}", prompt(50 + i, n)) for i, n in enumerate([21, 35, 60])]
    p.step()  # the holds reach the prefill's worker
    p.workers[0].kill()
    for i, out in enumerate(outs):
        d.add(f"dk{i}", prompt(50 + i, [21, 35, 60][i]), 2, decode_params(out))
    ids = [f"dk{i}" for i in range(3)]
    run_until([d], lambda: all(d.finished(r) is not None for r in ids), "the failed loads")
    for rid in ids:
        assert d.finished(rid).finish_reason.name == "LENGTH", rid  # recomputed, served
    assert worker_counter(d, "completed") == 0, d.worker_stats()
    assert worker_counter(d, "failed") == 3, d.worker_stats()
    run_until([d], d.all_free, "decode blocks free")
    check_clean(d)


def test_reader_before_the_hold(engines):
    """The prefill's scheduler hands the params out one step before its worker holds the
    blocks: a decode whose read starts in between waits for the hold (read grants), then
    loads byte-exact, and the prefill frees the blocks on the decode's release."""
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": LONG_LEASE_S})
    d = engines("decode", {"transport": "tcp"}, policy="fail")
    out = prefill_one(p, "e0", prompt(60, 40))
    assert p.live() == 0  # the hold goes to the worker with the prefill's next step
    d.add("de0", prompt(60, 40), 4, decode_params(out))
    for _ in range(3):  # the load starts: its read_start reaches a prefill with no hold yet
        d.step()
    assert d.sched.requests["de0"].status.name == "WAITING_FOR_REMOTE_KVS"
    run_until([p, d], lambda: d.sched.requests.get("de0") is not None and
              d.sched.requests["de0"].num_output_tokens >= 1, "the load, once the hold came")
    assert d.verify("de0") == []
    assert worker_counter(d, "completed") == 1, d.worker_stats()
    run_until([p, d], lambda: p.all_free() and d.all_free(), "all blocks free")
    assert worker_counter(p, "completed") == 1, p.worker_stats()  # read, not released unread
    assert worker_counter(p, "lease_expired") == 0
    check_clean(p, d)


def test_decode_death_frees_prefill_blocks_at_the_lease(engines):
    """No decode ever reads: the prefill's lease (request_timeout_s) gives the blocks back."""
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": SHORT_LEASE_S})
    for i, n in enumerate([17, 40, 65]):
        prefill_one(p, f"x{i}", prompt(70 + i, n))
    p.step()
    assert not p.all_free()
    run_until([p], p.all_free, "lease expiry")
    assert worker_counter(p, "lease_expired") == 3, p.worker_stats()
    check_clean(p)


def test_decode_with_the_prompt_in_its_prefix_cache_frees_prefill_at_once(engines):
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": LONG_LEASE_S})
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
    wait_free([p, d], "prefix-cache hit", RELEASE_DEADLINE_S, check=[p])
    assert worker_counter(p, "released") == released + 1
    assert worker_counter(p, "lease_expired") == 0
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
    run_loads(p, d, ["dt0", "dt1"])
    assert worker_counter(d, "completed") == 2
    wait_free([p, d], "all blocks", DEADLINE_S)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_prefill_tp1_decode_tp2(engines, kind):
    """Prefill TP 1 -> decode TP 2: each decode rank reads its half of the heads (MHA), or the
    whole replicated latent cache (MLA), from the one prefill rank, byte-exact against the
    prefill's heads. The prefill's hand-off has two readers (one per decode rank, each with its
    own read grant) and frees its blocks once both released it: completed, never released
    unread, failed or at the lease. The first hand-off's read_starts reach the prefill before
    its worker holds the blocks: both wait for the hold."""
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": LONG_LEASE_S}, kind=kind,
                tp=1)
    d = engines("decode", {"transport": "tcp"}, kind=kind, tp=2, policy="fail")
    rids = []
    for i, n in enumerate([17, 40, 100]):
        out = prefill_one(p, f"t{i}", prompt(30 + i, n))
        assert "tp_sources" not in out.kv_transfer_params
        rid = f"dt{i}"
        d.add(rid, prompt(30 + i, n), 4, decode_params(out))
        rids.append(rid)
        if i == 0:
            assert p.live() == 0  # the hold goes to the worker with the prefill's next step
            for _ in range(3):  # both ranks' read_starts reach a prefill with no hold yet
                d.step()
            assert d.sched.requests[rid].status.name == "WAITING_FOR_REMOTE_KVS"
    run_loads(p, d, rids)
    # Both ranks loaded every request (each rank's worker counts its own load).
    assert worker_counter(d, "completed") == 2 * len(rids), d.worker_stats()
    assert worker_counter(d, "failed") == 0, d.worker_stats()
    run_until([p, d], lambda: p.all_free() and d.all_free(), "all blocks free")
    assert worker_counter(p, "completed") == len(rids), p.worker_stats()
    for counter in ("released", "failed", "lease_expired"):
        assert worker_counter(p, counter) == 0, (counter, p.worker_stats())
    check_clean(p, d)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_decode_tp2_with_the_prompt_in_its_prefix_cache_frees_the_prefill(engines, kind):
    """Decode TP 2 that needs nothing from the prefill (all but the last token are in its
    prefix cache): its rank 0 tells the prefill, which frees the blocks at once (released
    unread), not after waiting for the other rank, nor at the lease."""
    p = engines("prefill", {"transport": "tcp", "request_timeout_s": LONG_LEASE_S}, kind=kind,
                tp=1)
    d = engines("decode", {"transport": "tcp"}, kind=kind, tp=2)
    tokens = prompt(31, 2 * BS + 1)
    d.add("warm", tokens, 1)
    run_until([d], lambda: d.finished("warm") is not None, "the decode's own prefill")
    params = decode_params(prefill_one(p, "h", tokens))
    p.step()
    assert not p.all_free()
    d.add("dh", tokens, 2, params)
    wait_free([p, d], "prefix-cache hit", RELEASE_DEADLINE_S, check=[p])
    assert worker_counter(p, "released") == 1
    assert worker_counter(p, "lease_expired") == 0
    run_until([d], lambda: d.finished("dh") is not None, "the decode request")
    assert worker_counter(d, "completed") == 0


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cpu_attention_rows_cleared_are_exactly_those_the_kernel_did_not_write(dtype_name):
    """Read grants clear the rows of a request's last block that it did not fill. Where a
    token's K and V lie in a page of vLLM's CPU attention is its kernels' choice (K is kept
    transposed for ISA vec): for every token count, the bytes kvwire clears must be exactly the
    bytes vLLM's own cpu_attn_reshape_and_cache did not write. A packing the plugin does not
    know must give no placement at all (grants then refuse), never a guess."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    import kvwire
    from kvwire import vllm_layout

    bs, heads, d = 32, 2, 32
    dtype = getattr(torch, dtype_name)
    es = torch.tensor([], dtype=dtype).element_size()
    sections = vllm_layout._cpu_attn_sections(dtype, bs, d, es, heads)
    isa = _get_attn_isa(dtype, bs, d)
    if sections is None:
        # Unknown packing: no placement, so a grant of a partly filled block is refused.
        assert isa != "vec", "ISA vec's packing is known and must be found"
        return
    page = heads * bs * 2 * d * es
    group = {"name": "kv", "layers": [0], "tokens_per_block": bs, "tokens_per_entry": 1,
             "window_tokens": 0, "per_request_state": False, "layer_base": [1 << 20],
             "page_bytes": page, "components": 1, "block_major": True,
             "heads": {"total": heads, "tp_size": 1, "tp_rank": 0, "outer": 1,
                       "inner_bytes": 2 * bs * d * es},
             "num_blocks": 1, "block_stride": page, "component_stride": 0,
             "section_row_bytes": sections}
    g = kvwire.Layout.from_json(json.dumps({"model": "cpu-attn", "groups": [group]})).groups[0]
    for n in (1, 5, bs - 1, bs):
        cache = torch.zeros((1, heads, bs, 2 * d), dtype=dtype)
        k_cache, v_cache = cache.view((1, heads, 2 * bs, d)).chunk(2, dim=2)
        kv = torch.ones((n, heads, d), dtype=dtype)
        ops.cpu_attn_reshape_and_cache(kv, kv, k_cache, v_cache,
                                       torch.arange(n, dtype=torch.long), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        written = set()
        for e in (cache.flatten() != 0).nonzero().flatten().tolist():
            written.update(range(e * es, (e + 1) * es))
        cleared = set()
        for off, length in g.unfilled_page_spans(0, n):
            cleared.update(range(off, off + length))
        assert not (cleared & written), f"{n} tokens: kvwire would clear bytes vLLM wrote"
        assert cleared | written == set(range(page)), \
            f"{n} tokens: bytes neither written nor cleared (an earlier request's would stay)"
