"""perf/serve_bench/bench_serve.py against a scripted OpenAI-style server in this process:
statistics, error counting by cause, the concurrency limit, leak detection through /health,
and the KV-wait share. The real servers are in bench_serve_e2e_test.py."""

import asyncio
import json
import math
import os
import random
import sys
import tempfile
import unittest

sys.path.insert(0, os.environ.get("KVWIRE_SERVE_BENCH_DIR", os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "perf", "serve_bench")))
import bench_serve  # noqa: E402
import serve_compare  # noqa: E402
from aiohttp import web  # noqa: E402


class Statistics(unittest.TestCase):
    def test_percentile_interpolates_like_numpy(self):
        self.assertEqual(bench_serve.percentile([], 50), 0.0)
        self.assertEqual(bench_serve.percentile([7], 99), 7)
        self.assertAlmostEqual(bench_serve.percentile([4, 1, 3, 2], 50), 2.5)
        self.assertAlmostEqual(bench_serve.percentile([1, 2, 3, 4], 90), 3.7)
        self.assertAlmostEqual(bench_serve.percentile(list(range(101)), 99), 99.0)

    def test_metrics_from_outcomes(self):
        O = bench_serve.Outcome
        outs = [O(success=True, prompt_len=10, output_tokens=3, ttft=0.1, itl=[0.02, 0.04],
                  latency=0.16, start_time=0.0, kv_wait_ms=25.0),
                O(success=True, prompt_len=10, output_tokens=1, ttft=0.3, itl=[], latency=0.3,
                  start_time=0.05, kv_wait_ms=75.0),
                O(success=False, prompt_len=10, error="HTTP 503: out of KV blocks: 3 free",
                  cause=bench_serve.error_cause("HTTP 503: out of KV blocks: 3 free"))]
        r = bench_serve.compute_metrics(outs, 2.0, [90, 99], num_instances=2)
        self.assertEqual((r["completed"], r["failed"]), (2, 1))
        self.assertEqual(r["total_input_tokens"], 20)
        self.assertEqual(r["total_output_tokens"], 4)
        self.assertAlmostEqual(r["request_throughput"], 1.0)
        self.assertAlmostEqual(r["output_throughput"], 2.0)
        self.assertAlmostEqual(r["output_throughput_per_instance"], 1.0)
        self.assertAlmostEqual(r["mean_ttft_ms"], 200.0)
        self.assertAlmostEqual(r["median_ttft_ms"], 200.0)
        # TPOT only for requests with more than one token: (0.16 - 0.1) / 2.
        self.assertAlmostEqual(r["mean_tpot_ms"], 30.0)
        self.assertAlmostEqual(r["interactivity_tok_s_user"], 1000 / 30.0)
        self.assertAlmostEqual(r["mean_itl_ms"], 30.0)
        self.assertAlmostEqual(r["p99_e2el_ms"], 160 + 140 * 0.99)
        self.assertAlmostEqual(r["kv_wait_share_of_ttft"], 100.0 / 400.0)
        self.assertEqual(r["errors_by_cause"], {"HTTP 503: out of KV blocks: N free": 1})
        self.assertEqual(r["max_concurrent_requests"], 2)

    def test_error_causes_group_ids_and_counts(self):
        a = bench_serve.error_cause("decode: transfer rt-0123456789abcdef0123 failed after 12 ms")
        b = bench_serve.error_cause("decode: transfer rt-fedcba9876543210fedc failed after 7 ms")
        self.assertEqual(a, b)
        self.assertNotEqual(a, bench_serve.error_cause("HTTP 400: bad prompt"))
        self.assertEqual(
            bench_serve.error_cause("HTTP 503: group 'c4a_state': 12 blocks needed, 3 free"),
            "HTTP 503: group 'c4a_state': N blocks needed, N free")
        self.assertNotEqual(bench_serve.error_cause("HTTP 503: x"),
                            bench_serve.error_cause("HTTP 502: x"))

    def test_kv_wait_read_and_write_mode(self):
        self.assertEqual(bench_serve.kv_wait_from({"load_wait_ms": 4.5}), 4.5)
        # Write mode: the tail after prefill's compute counts when decode had nothing left
        # to wait for; a negative tail (landed before compute ended) counts as none.
        self.assertEqual(bench_serve.kv_wait_from({"load_wait_ms": 0.0, "tail_ms": 3.0}), 3.0)
        self.assertEqual(bench_serve.kv_wait_from({"load_wait_ms": 0.0, "tail_ms": -2.0}), 0.0)
        self.assertEqual(bench_serve.kv_wait_from({"load_wait_ms": 6.0, "tail_ms": 3.0}), 6.0)
        self.assertIsNone(bench_serve.kv_wait_from({"peer": "x", "load_wait_ms": "1"}))

    def test_sse_pieces(self):
        s = bench_serve.SseEvents()
        self.assertEqual(s.feed(b"data: {\"a\""), [])
        self.assertEqual(s.feed(b": 1}\r\n\r\n: comment\n\ndata: [DO"), ["{\"a\": 1}"])
        self.assertEqual(s.feed(b"NE]\n\n"), ["[DONE]"])

    def test_arrivals(self):
        self.assertEqual(bench_serve.arrival_delays(3, math.inf, 1.0, random.Random(0)),
                         [0.0] * 3)
        d = bench_serve.arrival_delays(50, 10.0, 1.0, random.Random(1))
        self.assertEqual(d, sorted(d))
        self.assertAlmostEqual(d[-1], 5.0)


class Compare(unittest.TestCase):
    def test_same_tokens_across_configurations(self):
        def run(c, h, failed=0):
            return {"max_concurrency": c, "generated_texts_sha256": h, "failed": failed}

        same = {"a": [run(1, "x"), run(4, "y")], "b": [run(1, "x"), run(4, "y")]}
        self.assertTrue(serve_compare.same_tokens(same).startswith("yes"))
        differ = {"a": [run(1, "x"), run(4, "y")], "b": [run(1, "x"), run(4, "z")]}
        self.assertIn("NO, they differ (concurrency 4", serve_compare.same_tokens(differ))
        # A run with errors has fewer texts: left out rather than reported as a difference.
        partial = {"a": [run(1, "x")], "b": [run(1, "w", failed=1)]}
        self.assertTrue(serve_compare.same_tokens(partial).startswith("yes"))

    def test_runs_and_blocks(self):
        self.assertEqual(serve_compare.parse_runs("1:16,16:256"), [(1, 16), (16, 256)])
        for bad in ("0:4", "4:0", "4", "a:b"):
            with self.assertRaises(ValueError):
                serve_compare.parse_runs(bad)
        self.assertEqual(serve_compare.blocks_needed(256, 32, 20), 20 * (5 + 2))


class Datasets(unittest.TestCase):
    def test_random_prompts_have_the_asked_lengths(self):
        s = bench_serve.random_samples(20, 100, 8, seed=3)
        self.assertEqual(len(s), 20)
        for x in s:
            self.assertEqual(x.prompt_len, 100)
            self.assertEqual(len(x.prompt.encode()), 99)  # + BOS
            self.assertEqual(x.output_len, 8)
            self.assertTrue(x.prompt.isprintable())
        self.assertEqual(s, bench_serve.random_samples(20, 100, 8, seed=3))
        self.assertNotEqual(s, bench_serve.random_samples(20, 100, 8, seed=4))
        r = bench_serve.random_samples(200, 100, 10, seed=3, range_ratio=0.5)
        self.assertTrue(all(50 <= x.prompt_len <= 150 and 5 <= x.output_len <= 15 for x in r))
        self.assertGreater(len({x.prompt_len for x in r}), 10)
        with self.assertRaises(ValueError):
            bench_serve.random_samples(1, 0, 8, seed=0)

    def test_prompt_files(self):
        with tempfile.TemporaryDirectory() as d:
            jl = os.path.join(d, "p.jsonl")
            with open(jl, "w") as f:
                f.write('{"prompt": "héllo"}\n\n{"prompt": "ab", "output_len": 3}\n')
            s = bench_serve.file_samples(jl, 5, 7)
            self.assertEqual([x.prompt for x in s], ["héllo", "ab", "héllo", "ab", "héllo"])
            self.assertEqual(s[0].prompt_len, 7)  # 6 UTF-8 bytes + BOS
            self.assertEqual([x.output_len for x in s[:2]], [7, 3])
            txt = os.path.join(d, "p.txt")
            with open(txt, "w") as f:
                f.write("one\ntwo\n")
            self.assertEqual([x.prompt for x in bench_serve.file_samples(txt, 3, 1)],
                             ["one", "two", "one"])
            for bad in ('{"prompt": 3}', "not json", '{"prompt": "x", "output_len": 0}'):
                with open(jl, "w") as f:
                    f.write(bad + "\n")
                with self.assertRaises(ValueError) as e:
                    bench_serve.file_samples(jl, 1, 1)
                self.assertIn("p.jsonl:1", str(e.exception))


class ScriptedServer:
    """Streams `tokens` tokens per request; request i (by arrival) fails with 503 when
    i % 5 == 4, and with an error event after its first token when i % 7 == 6."""

    def __init__(self, leak_blocks=0, held_blocks=0, fail=True, health=None):
        self.count = 0
        self.inflight = 0
        self.max_inflight = 0
        self.leak_blocks = leak_blocks
        self.held_blocks = held_blocks
        self.fail = fail  # False: every request completes
        self.health_answer = health  # replaces /health's JSON when set

    async def completions(self, request):
        body = await request.json()
        i = self.count
        self.count += 1
        if self.fail and i % 5 == 4:
            return web.json_response({"error": {"message": f"out of KV blocks: need {i}",
                                                "code": 503}}, status=503)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(0.02)
            for t in range(body["max_tokens"]):
                ev = {"choices": [{"text": "x", "token_ids": [65 + t]}]}
                await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
                if self.fail and i % 7 == 6:
                    err = {"error": {"message": f"decode server 127.0.0.1:{9000 + i} failed",
                                     "code": 502}}
                    await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                    return resp
                await asyncio.sleep(0.005)
            last = {"choices": [{"text": "", "token_ids": [], "finish_reason": "length"}],
                    "kvwire": {"transfer": {"load_wait_ms": 5.0}}}
            await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
            return resp
        finally:
            self.inflight -= 1

    async def health(self, request):
        if self.health_answer is not None:
            return web.json_response(self.health_answer)
        return web.json_response({"role": "both", "used_blocks": self.leak_blocks,
                                  "held_blocks": self.held_blocks})

    async def metrics(self, request):
        return web.Response(text=f'kvwire_dsv4_kv_load_wait_seconds_total{{engine="e"}} '
                                 f'{0.005 * self.count}\n# TYPE x counter\n')


class AgainstScriptedServer(unittest.IsolatedAsyncioTestCase):
    async def start(self, server):
        app = web.Application()
        app.router.add_post("/v1/completions", server.completions)
        app.router.add_get("/health", server.health)
        app.router.add_get("/metrics", server.metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def asyncTearDown(self):
        await self.runner.cleanup()

    async def test_counts_errors_by_cause_and_respects_concurrency(self):
        server = ScriptedServer()
        url = await self.start(server)
        samples = bench_serve.random_samples(30, 16, 4, seed=0)
        r = await bench_serve.run_benchmark([url], samples, concurrency=3, progress=False,
                                            warmup=0, settle_timeout=1)
        self.assertEqual(server.count, 30)
        self.assertLessEqual(server.max_inflight, 3)
        self.assertLessEqual(r["max_concurrent_requests"], 3)
        # Requests 4, 9, ... (6 of 30) get 503; 6, 13, 20, 27 an error event: 20 complete.
        self.assertEqual(r["failed"], 10)
        self.assertEqual(r["completed"], 20)
        self.assertEqual(sorted(r["errors_by_cause"].values()), [4, 6])
        self.assertIn("HTTP 503: out of KV blocks: need N", r["errors_by_cause"])
        self.assertEqual(r["errors_by_cause"]["error event 502: decode server N.N.N.N:N failed"],
                         4)
        self.assertEqual(r["total_output_tokens"], 80)
        self.assertEqual(r["output_lens"].count(4), 20)
        for ttft, itl, lat, err in zip(r["ttfts"], r["itls"], r["latencies"], r["errors"]):
            if not err:
                self.assertGreater(ttft, 0.015)
                self.assertEqual(len(itl), 3)
                self.assertGreater(lat, ttft)
        self.assertEqual(r["kv_wait_reported"], 20)
        self.assertGreater(r["kv_wait_share_of_ttft"], 0)
        self.assertLess(r["kv_wait_share_of_ttft"], 1)
        self.assertIsNotNone(r["kv_wait_share_of_ttft_metrics"])
        self.assertEqual(r["leaked_blocks"], 0)
        self.assertEqual(r["num_instances"], 1)

    async def test_request_rate_paces_the_sends(self):
        server = ScriptedServer()
        url = await self.start(server)
        # 10 requests at 40/s: the last one goes out 0.25 s after the first, whatever the
        # server does (the client's own pacing, not a speed claim).
        samples = bench_serve.random_samples(4, 8, 1, seed=0) * 2 + [
            bench_serve.Sample("a", 2, 1)] * 2
        r = await bench_serve.run_benchmark([url], samples, concurrency=None,
                                            request_rate=40.0, progress=False, warmup=0,
                                            settle_timeout=0.3, seed=2)
        self.assertEqual(r["completed"] + r["failed"], 10)
        self.assertGreaterEqual(r["duration"], 0.24)

    async def test_reports_blocks_left_in_use(self):
        server = ScriptedServer(leak_blocks=3)
        url = await self.start(server)
        r = await bench_serve.run_benchmark([url], bench_serve.random_samples(2, 8, 2, seed=0),
                                            concurrency=1, progress=False, warmup=1,
                                            settle_timeout=0.3)
        self.assertEqual(r["leaked_blocks"], 3)
        self.assertEqual(r["instances"][0]["used_blocks"], 3)

    async def test_blocks_held_for_a_reader_count_as_leaked(self):
        server = ScriptedServer(held_blocks=2)
        url = await self.start(server)
        r = await bench_serve.run_benchmark([url], bench_serve.random_samples(2, 8, 2, seed=0),
                                            concurrency=1, progress=False, warmup=0,
                                            settle_timeout=0.3)
        self.assertEqual(r["leaked_blocks"], 2)
        self.assertEqual(r["instances"][0]["held_blocks"], 2)

    async def test_an_instance_without_health_is_unreachable_not_zero_leaked(self):
        server = ScriptedServer(fail=False)
        url = await self.start(server)
        dead = "http://127.0.0.1:1"  # nothing listens on port 1 for an unprivileged test
        r = await bench_serve.run_benchmark([url], bench_serve.random_samples(2, 8, 2, seed=0),
                                            concurrency=1, progress=False, warmup=0,
                                            instances=[url, dead], settle_timeout=0.3)
        self.assertEqual(r["failed"], 0)
        self.assertEqual(r["instances_unreachable"], 1)
        self.assertIn("error", r["instances"][1])

    async def test_strict_fails_on_an_unreachable_or_silent_instance(self):
        # main() runs its own event loop: in a thread. The requests all complete and no
        # block is in use, so only the instance that cannot say so fails --strict.
        server = ScriptedServer(fail=False)
        url = await self.start(server)
        argv = ["--base-url", url, "--num-prompts", "2", "--random-input-len", "8",
                "--random-output-len", "2", "--num-warmups", "0", "--settle-timeout", "0.3",
                "--disable-tqdm", "--strict", "--instance", url]
        self.assertEqual(await asyncio.to_thread(bench_serve.main, argv), 0)
        self.assertEqual(
            await asyncio.to_thread(bench_serve.main, argv + ["--instance", "http://127.0.0.1:1"]),
            1)
        # Answers /health, but not with the block counts: unknown, not "0 leaked".
        server.health_answer = {"role": "both"}
        self.assertEqual(await asyncio.to_thread(bench_serve.main, argv), 1)
        server.health_answer = None
        server.held_blocks = 1
        self.assertEqual(await asyncio.to_thread(bench_serve.main, argv), 1)

    async def test_unreachable_server_is_a_counted_error(self):
        server = ScriptedServer()
        url = await self.start(server)
        dead = "http://127.0.0.1:1"  # nothing listens on port 1 for an unprivileged test
        r = await bench_serve.run_benchmark([url, dead], bench_serve.random_samples(4, 8, 2, 0),
                                            concurrency=2, progress=False, warmup=0,
                                            instances=[url], settle_timeout=0.3)
        self.assertEqual(r["failed"], 2)
        (cause,) = r["errors_by_cause"]
        self.assertTrue(cause.startswith("connection: ClientConnectorError"), cause)


if __name__ == "__main__":
    unittest.main()
