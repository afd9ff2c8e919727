"""perf/serve_bench/bench_serve.py against real kvwire-dsv4 servers (tiny config, weights
generated into a temporary folder): 1P1D behind the router through the command line (JSON
files with vLLM's keys, sane values, counts that match, no errors, no leaked blocks, the
KV-wait share reported), and two aggregated servers in-process (requests spread round
robin; the same tokens as 1P1D). Not a speed test.

Environment: KVWIRE_DSV4_BIN (the kvwire-dsv4 binary), KVWIRE_DSV4_CONFIG (tiny.json).
"""

import asyncio
import glob
import json
import os
import subprocess
import sys
import tempfile
import unittest

BENCH_DIR = os.environ.get("KVWIRE_SERVE_BENCH_DIR", os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "perf", "serve_bench"))
sys.path.insert(0, BENCH_DIR)
import bench_serve  # noqa: E402
import dsv4_cluster  # noqa: E402

BIN = os.environ.get("KVWIRE_DSV4_BIN", "")
CONFIG = os.environ.get("KVWIRE_DSV4_CONFIG", "")
INPUT_LEN, OUTPUT_LEN, PROMPTS = 64, 4, 8

# Keys `vllm bench serve` writes (vllm/benchmarks/serve.py), all of which this tool writes.
VLLM_KEYS = ["date", "backend", "label", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
    for s in ("mean", "median", "std", "p90", "p99")]
KVWIRE_KEYS = ["num_instances", "output_throughput_per_instance", "interactivity_tok_s_user",
               "kv_wait_share_of_ttft", "kv_wait_share_of_ttft_metrics", "kv_wait_reported",
               "errors_by_cause", "leaked_blocks", "instances"]


# Written by main() (the command line) about the invocation, not by run_benchmark.
CLI_KEYS = {"date", "backend", "label", "num_prompts", "request_rate", "burstiness",
            "max_concurrency"}


class BenchServeE2e(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.access(BIN, os.X_OK) or not os.path.exists(CONFIG):
            raise RuntimeError(f"KVWIRE_DSV4_BIN ({BIN!r}) and KVWIRE_DSV4_CONFIG ({CONFIG!r}) "
                               "must name the built kvwire-dsv4 and tiny.json")
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvwire-bench-e2e-")
        cls.weights = dsv4_cluster.ensure_weights(BIN, CONFIG,
                                                  os.path.join(cls.tmp.name, "w.safetensors"))
        cls.samples = bench_serve.random_samples(PROMPTS, INPUT_LEN, OUTPUT_LEN, seed=5)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def check_run(self, r, concurrency, instances, cli=True):
        # The command line writes every key; run_benchmark (in-process) all but those that
        # main() adds about the invocation, which are then not asserted at all.
        for k in VLLM_KEYS + KVWIRE_KEYS:
            if cli or k not in CLI_KEYS:
                self.assertIn(k, r)
        if cli:
            self.assertEqual(r["max_concurrency"], concurrency)
        self.assertEqual(r["instances_unreachable"], 0, r["instances"])
        self.assertEqual(r["failed"], 0, r["errors_by_cause"])
        self.assertEqual(r["errors_by_cause"], {})
        self.assertEqual(r["completed"], PROMPTS)
        self.assertEqual(r["total_input_tokens"], PROMPTS * INPUT_LEN)
        self.assertGreaterEqual(r["total_output_tokens"], PROMPTS)  # at least one token each
        self.assertLessEqual(r["total_output_tokens"], PROMPTS * OUTPUT_LEN)
        self.assertAlmostEqual(r["request_throughput"], PROMPTS / r["duration"], places=6)
        self.assertAlmostEqual(r["output_throughput_per_instance"],
                               r["output_throughput"] / instances, places=6)
        self.assertEqual(r["num_instances"], instances)
        self.assertEqual(len(r["instances"]), instances)
        self.assertEqual(r["leaked_blocks"], 0, r["instances"])
        for inst in r["instances"]:
            self.assertEqual(inst["used_blocks"], 0, inst)
            self.assertEqual(inst["requests_error"], 0, inst)
        self.assertLessEqual(r["max_concurrent_requests"], concurrency)
        for m in ("ttft", "e2el"):
            self.assertGreater(r[f"mean_{m}_ms"], 0)
            self.assertLessEqual(r[f"median_{m}_ms"], r[f"p99_{m}_ms"])
            self.assertLessEqual(r[f"p90_{m}_ms"], r[f"p99_{m}_ms"])
        self.assertLess(r["mean_ttft_ms"], r["mean_e2el_ms"])

    def test_1p1d_through_the_command_line_and_aggregated_in_process(self):
        out = os.path.join(self.tmp.name, "results")
        with dsv4_cluster.Cluster(BIN, os.path.join(self.tmp.name, "pd")) as c:
            base, inst = dsv4_cluster.start_disaggregated(
                c, CONFIG, self.weights, mode="read", transport="tcp", threads=1,
                max_requests=8)
            p = subprocess.run(
                [sys.executable, os.path.join(BENCH_DIR, "bench_serve.py"), "--base-url",
                 base[0], "--random-input-len", str(INPUT_LEN), "--random-output-len",
                 str(OUTPUT_LEN), "--num-prompts", str(PROMPTS), "--seed", "5",
                 "--max-concurrency", "1,4", "--save-result", "--save-detailed",
                 "--result-dir", out, "--result-filename", "pd.json", "--disable-tqdm",
                 "--strict"], capture_output=True, text=True, timeout=240)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("Serving Benchmark Result", p.stdout)
            c.check_alive()
            codes = c.stop()
        self.assertEqual(set(codes.values()), {0}, codes)
        files = sorted(glob.glob(os.path.join(out, "pd-concurrency*.json")))
        self.assertEqual([os.path.basename(f) for f in files],
                         ["pd-concurrency1.json", "pd-concurrency4.json"])
        pd_texts = None
        for f, conc in zip(files, (1, 4)):
            with open(f) as fh:
                r = json.load(fh)
            self.check_run(r, conc, instances=2)
            self.assertEqual(sorted(i["role"] for i in r["instances"]), ["decode", "prefill"])
            # Every request went prefill -> decode and reports the decode's KV wait.
            self.assertEqual(r["kv_wait_reported"], PROMPTS)
            self.assertGreater(r["kv_wait_share_of_ttft"], 0)
            self.assertLess(r["kv_wait_share_of_ttft"], 1)
            self.assertGreater(r["kv_wait_share_of_ttft_metrics"], 0)
            self.assertLess(r["kv_wait_share_of_ttft_metrics"], 1)
            self.assertEqual(len(r["ttfts"]), PROMPTS)
            self.assertEqual(sum(r["output_lens"]), r["total_output_tokens"])
            self.assertEqual(sum(len(x) for x in r["itls"]),
                             r["total_output_tokens"] - PROMPTS)
            if pd_texts is None:
                pd_texts = r["generated_texts"]
            self.assertEqual(r["generated_texts"], pd_texts)  # greedy: the same tokens

        with dsv4_cluster.Cluster(BIN, os.path.join(self.tmp.name, "agg")) as c:
            base, inst = dsv4_cluster.start_aggregated(c, CONFIG, self.weights, instances=2,
                                                       threads=1, max_requests=8)
            r = asyncio.run(bench_serve.run_benchmark(base, self.samples, concurrency=2,
                                                      percentiles=(90, 99), progress=False))
            c.check_alive()
        self.check_run(r, 2, instances=2, cli=False)
        self.assertEqual([i["requests_ok"] for i in r["instances"]], [PROMPTS / 2] * 2)
        self.assertEqual(r["kv_wait_reported"], 0)
        self.assertIsNone(r["kv_wait_share_of_ttft"])
        self.assertEqual(r["generated_texts"], pd_texts)


if __name__ == "__main__":
    unittest.main()
