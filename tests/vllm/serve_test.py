"""vLLM serving on the CPU, disaggregated through kvwire: real `vllm serve` processes.

One aggregated server (no connector) and, per transport (tcp, shm), a prefill and a decode server
with kv_connector KvwireConnector ("mode": "auto": each request picks read or write), behind
examples/vllm/pd_proxy.py in vLLM's P/D protocol. The model is a tiny config this test writes
(seeded weights at a normal scale, not --load-format dummy, whose outputs ignore the KV; a
word-level tokenizer built here): nothing is downloaded. Checked, per transport and per mode:
  - greedy outputs through the proxy equal the aggregated server's, for prompts of 1, 15, 16,
    17, 31, 32, 33 and 300 tokens (block size 32, the smallest vLLM's CPU attention takes:
    below, at and past a block boundary, and past half a block);
  - the decode moved the KV through kvwire (its connector counted the transfers), it did not
    recompute the prompt;
  - 50 requests at concurrency 8 all answer, equal to the aggregated server, and both servers
    end with no KV blocks in use (vllm:kv_cache_usage_perc 0) within a few seconds.

Run in the vLLM virtual environment (make test-vllm-serve):
    KVWIRE_VLLM_ARCH=llama|deepseek_v2  (default llama)
    KVWIRE_VLLM_TRANSPORTS=tcp,shm      (default both)
"""
import concurrent.futures
import os
import random
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "examples", "vllm"))

import serving  # noqa: E402
import tiny_model  # noqa: E402

ARCH = os.environ.get("KVWIRE_VLLM_ARCH", "llama")
TRANSPORTS = [t for t in os.environ.get("KVWIRE_VLLM_TRANSPORTS", "tcp,shm").split(",") if t]
START_TIMEOUT_S = float(os.environ.get("KVWIRE_VLLM_START_TIMEOUT_S", "600"))
LENGTHS = (1, 15, 16, 17, 31, 32, 33, 300)
MAX_TOKENS = 8
N_LOAD, CONCURRENCY = 50, 8


def prompt_of(length: int, seed: int) -> list:
    rng = random.Random(seed * 1000003 + length)
    return [rng.randrange(3, tiny_model.VOCAB) for _ in range(length)]


class VllmServeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvwire-vllm-serve-")
        cls.logs = os.environ.get("KVWIRE_VLLM_LOG_DIR") or cls.tmp.name
        os.makedirs(cls.logs, exist_ok=True)
        cls.model = tiny_model.write_model(os.path.join(cls.tmp.name, "model"), ARCH)
        cls.procs = []
        cls.agg = cls.start(serving.VllmServer(f"{ARCH}-aggregated", cls.model, cls.logs))
        cls.pairs = {}
        for t in TRANSPORTS:
            kv_port = serving.free_port()
            env = serving.server_env()
            if t == "shm":
                # vLLM's CPU KV cache is plain process memory (not a kvwire ShareableBuffer):
                # shm moves it by cross-memory attach, which each engine must opt in to
                # (docs/SECURITY-shm.md); without it every shm load fails ("shm does not reach
                # every remote region of this transfer").
                env["KVWIRE_SHM_CMA"] = "1"
            p = cls.start(serving.VllmServer(f"{ARCH}-{t}-prefill", cls.model, cls.logs,
                                             serving.kvwire_config(t, kv_port), env=env))
            d = cls.start(serving.VllmServer(f"{ARCH}-{t}-decode", cls.model, cls.logs,
                                             serving.kvwire_config(t), env=env))
            cls.pairs[t] = (p, d, f"127.0.0.1:{kv_port}")
        for proc in cls.procs:
            proc.wait_ready(START_TIMEOUT_S)
        cls.proxies = {}
        for t, (p, d, kv) in cls.pairs.items():
            for mode in ("read", "write"):
                x = serving.PdProxy(f"{ARCH}-{t}-{mode}-proxy", p, d, cls.logs, mode, kv)
                cls.procs.append(x)
                x.wait_ready()
                cls.proxies[(t, mode)] = x
        cls.expected = {}

    @classmethod
    def start(cls, proc):
        cls.procs.append(proc)
        return proc

    @classmethod
    def tearDownClass(cls):
        for proc in reversed(getattr(cls, "procs", [])):
            proc.stop()
        cls.tmp.cleanup()

    def logs_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(25)}" for p in self.procs)

    def aggregated(self, prompt: list) -> list:
        key = tuple(prompt)
        if key not in self.expected:
            ans = serving.completion(self.agg.url, prompt, MAX_TOKENS)
            self.expected[key] = serving.output_tokens(ans)
        return self.expected[key]

    @staticmethod
    def transferred(decode) -> float:
        """Prompt tokens the decode got from the connector (not computed, not cached)."""
        return decode.metric("vllm:prompt_tokens_by_source_total",
                             'source="external_kv_transfer"')

    def wait_no_blocks_in_use(self, *servers, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        usage = {}
        while time.monotonic() < deadline:
            usage = {s.name: s.metric("vllm:kv_cache_usage_perc") for s in servers}
            if all(u == 0 for u in usage.values()):
                return
            time.sleep(0.2)
        self.fail(f"KV blocks still in use after {timeout_s} s: {usage}\n{self.logs_tail()}")

    def check_equal(self, transport: str, mode: str) -> None:
        proxy = self.proxies[(transport, mode)]
        p, d, _ = self.pairs[transport]
        for n in LENGTHS:
            prompt = prompt_of(n, 1 + ("read", "write").index(mode))
            want = self.aggregated(prompt)
            before = self.transferred(d)
            got = serving.output_tokens(serving.completion(proxy.url, prompt, MAX_TOKENS))
            self.assertEqual(got, want, f"{transport}/{mode}: prompt of {n} tokens\n"
                                        f"{self.logs_tail()}")
            if n > 1:  # decode computes the last prompt token itself; the rest came by kvwire
                self.assertGreaterEqual(self.transferred(d) - before, n - 1,
                                        f"{transport}/{mode}: prompt of {n} tokens was not "
                                        f"loaded through the connector")
        self.wait_no_blocks_in_use(p, d)

    def check_load(self, transport: str, mode: str) -> None:
        proxy = self.proxies[(transport, mode)]
        p, d, _ = self.pairs[transport]
        lengths = [random.Random(i).choice(LENGTHS + (40, 100)) for i in range(N_LOAD)]
        # Prompts of their own per mode: read and write share one prefill/decode pair, and the
        # decode's prefix cache would otherwise serve the second mode's prompts itself.
        prompts = [prompt_of(n, (100 if mode == "read" else 200) + i)
                   for i, n in enumerate(lengths)]
        before = self.transferred(d)
        with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            got = list(pool.map(lambda pr: serving.output_tokens(
                serving.completion(proxy.url, pr, MAX_TOKENS)), prompts))
        want = [self.aggregated(pr) for pr in prompts]
        bad = [i for i in range(N_LOAD) if got[i] != want[i]]
        self.assertEqual(bad, [], f"{transport}/{mode}: {len(bad)} of {N_LOAD} differ")
        # Equal outputs alone would pass if every load failed and vLLM recomputed the prompts.
        self.assertGreaterEqual(self.transferred(d) - before, sum(n - 1 for n in lengths),
                                f"{transport}/{mode}: the concurrent prompts were not all "
                                f"loaded through the connector")
        self.wait_no_blocks_in_use(p, d)


def _add_tests():
    for t in TRANSPORTS:
        for mode in ("read", "write"):
            def eq(self, t=t, mode=mode):
                self.check_equal(t, mode)

            def load(self, t=t, mode=mode):
                self.check_load(t, mode)
            setattr(VllmServeTest, f"test_{t}_{mode}_equal_to_aggregated", eq)
            setattr(VllmServeTest, f"test_{t}_{mode}_50_requests_concurrency_8", load)


_add_tests()

if __name__ == "__main__":
    unittest.main(verbosity=2)
