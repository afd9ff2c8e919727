#!/usr/bin/python3
"""Aggregated vs 1P1D (read and write mode, over tcp and shm), the comparison InferenceX
makes for DeepSeek-V4 disaggregation, scaled to one small machine (`make serve-bench`).

Every configuration gets the same compute: --threads-total model threads split evenly over
its instances (aggregated: two whole servers, the client spreading requests over them round
robin like a data-parallel balancer; 1P1D: one prefill and one decode server behind the
router). Each configuration runs bench_serve.py at every concurrency of --runs, then its
servers stop. Writes one vLLM-shaped JSON per run, a PNG of throughput per instance against
interactivity, and the table of examples/dsv4/BENCHMARK.md (with the command that made it
and the machine load before and after).
"""

import argparse
import asyncio
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402
import dsv4_cluster  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    # name: (kind, mode, transport)
    "aggregated": ("agg", None, None),
    "1P1D read tcp": ("pd", "read", "tcp"),
    "1P1D read shm": ("pd", "read", "shm"),
    "1P1D write tcp": ("pd", "write", "tcp"),
    "1P1D write shm": ("pd", "write", "shm"),
}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        with open("/proc/loadavg") as f:
            return "load average: " + ", ".join(f.read().split()[:3])


def load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def parse_runs(text: str) -> list[tuple[int, int]]:
    """"1:16,4:64,16:256" -> [(concurrency, num_prompts), ...]"""
    runs = []
    for part in text.split(","):
        c, _, n = part.partition(":")
        runs.append((int(c), int(n)))
    if not runs or any(c < 1 or n < 1 for c, n in runs):
        raise ValueError("--runs takes concurrency:num_prompts pairs, both >= 1")
    return runs


def blocks_needed(input_len: int, output_len: int, requests: int) -> int:
    """Blocks per paged group for `requests` requests at once: one per 64 tokens (the
    smallest block) plus one spare each, so the cache never runs out during the run."""
    return requests * (math.ceil((input_len + output_len) / 64) + 2)


def run_config(name: str, args, weights: str, out_dir: str, runs_text: str,
               server_defaults: bool = False) -> tuple[list[dict], str]:
    """Starts one configuration, runs bench_serve at each concurrency, stops it. With
    server_defaults the servers keep their own --max-requests, --num-blocks and
    --request-timeout-s (what a deployment without tuning gets)."""
    kind, mode, transport = CONFIGS[name]
    runs = parse_runs(runs_text)
    if server_defaults:
        max_req, blocks, extra = 0, 0, []
    else:
        max_req = max(c for c, _ in runs) + 4
        blocks = args.num_blocks or blocks_needed(args.input_len, args.output_len, max_req)
        extra = ["--request-timeout-s", str(int(math.ceil(args.request_timeout)))]
    tag = name.replace(" ", "-") + ("-server-defaults" if server_defaults else "")
    work = os.path.join(out_dir, "logs", tag)
    results = []
    stop_note = ""
    with dsv4_cluster.Cluster(args.bin, work) as cluster:
        if kind == "agg":
            n = args.agg_instances
            base, inst = dsv4_cluster.start_aggregated(
                cluster, args.config, weights, instances=n, threads=args.threads_total // n,
                num_blocks=blocks, max_requests=max_req, extra=extra)
        else:
            base, inst = dsv4_cluster.start_disaggregated(
                cluster, args.config, weights, mode=mode, transport=transport,
                threads=args.threads_total // 2, num_blocks=blocks, max_requests=max_req,
                extra=extra)
        for conc, num in runs:
            samples = bench_serve.random_samples(num, args.input_len, args.output_len, args.seed)
            label = f"{name} c={conc}" + (" (server defaults)" if server_defaults else "")
            r = asyncio.run(bench_serve.run_benchmark(
                base, samples, concurrency=conc, instances=inst, percentiles=(90, 99),
                request_timeout=args.request_timeout, progress=not args.no_progress,
                label=label, seed=args.seed))
            cluster.check_alive()
            r = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai",
                 "label": name, "num_prompts": num, "request_rate": "inf",
                 "max_concurrency": conc, "input_len": args.input_len,
                 "output_len": args.output_len, "config": os.path.basename(args.config),
                 "threads_total": args.threads_total, "server_defaults": server_defaults,
                 "num_blocks": blocks or "default", "max_requests": max_req or "default", **r}
            # Greedy decoding of the same prompts: every configuration must produce the same
            # text, whatever moved the KV (checked across configurations in the report).
            r["generated_texts_sha256"] = hashlib.sha256(
                json.dumps(r["generated_texts"]).encode()).hexdigest()
            for k in bench_serve.DETAILED:
                r.pop(k, None)
            path = os.path.join(out_dir, f"{tag}-c{conc}.json")
            with open(path, "w") as f:
                json.dump(r, f, indent=2)
            print(f"{label}: {r['completed']} ok, {r['failed']} failed, "
                  f"{r['output_throughput']:.1f} tok/s, TTFT {r['median_ttft_ms']:.0f} ms, "
                  f"TPOT {r['median_tpot_ms']:.1f} ms, leaked {r['leaked_blocks']}", flush=True)
            for cause, count in r["errors_by_cause"].items():
                print(f"  {count} x {cause}", flush=True)
            results.append(r)
        codes = cluster.stop()
        bad = {k: v for k, v in codes.items() if v != 0}
        if bad:
            stop_note = f"unclean exits: {bad}"
    return results, stop_note


def fmt(v, digits=1):
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}"


def table(all_results: dict[str, list[dict]]) -> str:
    head = ("| configuration | conc. | requests | failed | req/s | output tok/s | tok/s per "
            "instance | tok/s/user | TTFT mean / median / p90 / p99 (ms) | TPOT mean / p99 "
            "(ms) | ITL median / p99 (ms) | E2EL mean / p99 (ms) | KV wait share of TTFT | "
            "blocks in use after |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, runs in all_results.items():
        for r in runs:
            share = r.get("kv_wait_share_of_ttft")
            share = "n/a (aggregated)" if share is None else f"{100 * share:.1f}%"
            lines.append(
                f"| {name} | {r['max_concurrency']} | {r['completed'] + r['failed']} | "
                f"{r['failed']} | {fmt(r['request_throughput'], 2)} | "
                f"{fmt(r['output_throughput'])} | {fmt(r['output_throughput_per_instance'])} | "
                f"{fmt(r['interactivity_tok_s_user'])} | {fmt(r['mean_ttft_ms'], 0)} / "
                f"{fmt(r['median_ttft_ms'], 0)} / {fmt(r['p90_ttft_ms'], 0)} / "
                f"{fmt(r['p99_ttft_ms'], 0)} | {fmt(r['mean_tpot_ms'])} / {fmt(r['p99_tpot_ms'])}"
                f" | {fmt(r['median_itl_ms'])} / {fmt(r['p99_itl_ms'])} | "
                f"{fmt(r['mean_e2el_ms'], 0)} / {fmt(r['p99_e2el_ms'], 0)} | {share} | "
                f"{r['leaked_blocks']} |")
    return "\n".join(lines)


def kv_table(all_results: dict[str, list[dict]]) -> str:
    lines = ["| configuration | conc. | TTFT mean (ms) | KV wait mean / p99 (ms) | share "
             "(responses) | share (/metrics: decode's wait) |", "|---|---|---|---|---|---|"]
    for name, runs in all_results.items():
        for r in runs:
            if r.get("kv_wait_reported", 0) == 0:
                continue
            s, sm = r.get("kv_wait_share_of_ttft"), r.get("kv_wait_share_of_ttft_metrics")
            lines.append(f"| {name} | {r['max_concurrency']} | {fmt(r['mean_ttft_ms'], 0)} | "
                         f"{fmt(r.get('mean_kv_wait_ms'))} / {fmt(r.get('p99_kv_wait_ms'))} | "
                         f"{'n/a' if s is None else f'{100 * s:.1f}%'} | "
                         f"{'n/a' if sm is None else f'{100 * sm:.1f}%'} |")
    return "\n".join(lines)


def same_tokens(all_results: dict[str, list[dict]]) -> str:
    """Whether every configuration generated the same text at each concurrency."""
    by_conc: dict[int, dict[str, str]] = {}
    for name, runs in all_results.items():
        for r in runs:
            if r["failed"] == 0:
                by_conc.setdefault(r["max_concurrency"], {})[name] = r["generated_texts_sha256"]
    differ = [f"concurrency {c}: {sorted(h.items(), key=lambda kv: kv[1])}"
              for c, h in sorted(by_conc.items()) if len(set(h.values())) > 1]
    if not by_conc:
        return "no run without errors to compare"
    if differ:
        return "NO, they differ (" + "; ".join(differ) + ")"
    return "yes, at every concurrency (runs without errors compared)"


def defaults_table(defaults: dict[str, list[dict]]) -> str:
    lines = ["| configuration | conc. | requests | completed | failed, by cause | blocks in use "
             "after |", "|---|---|---|---|---|---|"]
    for name, runs in defaults.items():
        for r in runs:
            causes = "; ".join(f"{n} x {c}" for c, n in r["errors_by_cause"].items()) or "none"
            lines.append(f"| {name} | {r['max_concurrency']} | {r['completed'] + r['failed']} | "
                         f"{r['completed']} | {r['failed']}: {causes} | {r['leaked_blocks']} |")
    return "\n".join(lines)


def write_doc(path, png_rel, args, command, before, after, all_results, defaults, notes,
              elapsed):
    total = sum(r["completed"] + r["failed"] for rs in all_results.values() for r in rs)
    failed = sum(r["failed"] for rs in all_results.values() for r in rs)
    leaked = sum(r["leaked_blocks"] for rs in all_results.values() for r in rs)
    errors: dict[str, int] = {}
    for rs in all_results.values():
        for r in rs:
            for c, n in r["errors_by_cause"].items():
                errors[c] = errors.get(c, 0) + n
    defaults_section = "" if not defaults else (
        "### The same load on the servers' defaults\n\n"
        "With the servers' own `--max-requests` (4), `--num-blocks` and `--request-timeout-s`\n"
        "(60), as a deployment gets them without tuning (no admission queue yet: a request that\n"
        "finds no free KV block fails at once). Failures are counted by cause, not hidden:\n\n"
        f"{defaults_table(defaults)}\n\n")
    doc = f"""# Serving benchmark: aggregated vs 1P1D

Generated by `perf/serve_bench/serve_compare.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC
({elapsed / 60:.1f} min). Regenerate with:

```
{command}
```

(`make serve-bench` runs the default; `SERVE_BENCH_ARGS='--quick'` the reduced one.) vLLM's own
client, `vllm bench serve`, at the seeds' 8k/1k shape: [BENCHMARK-vllm.md](BENCHMARK-vllm.md)
(`make serve-bench-vllm`).

## Set-up

- Model: `{os.path.basename(args.config)}` (the reference DeepSeek-V4 engine on the CPU,
  random weights, byte tokenizer), random prompts of {args.input_len} tokens, {args.output_len}
  output tokens (greedy; a request may stop early at EOS), all requests sent at once and
  limited to the concurrency (`--max-concurrency`, as `vllm bench serve`).
- Same compute for every configuration: {args.threads_total} model threads in all.
  *aggregated*: {args.agg_instances} whole servers × {args.threads_total // args.agg_instances}
  thread(s), the client spreading requests round robin (a data-parallel balancer);
  *1P1D*: one prefill and one decode server × {args.threads_total // 2} thread(s) behind
  `kvwire-dsv4 router`, in read mode (decode pulls) or write mode (prefill pushes each layer
  as it is computed), over the tcp or the shm transport. Throughput per instance divides by 2
  in both.
- Servers: `--max-requests` and `--num-blocks` are set for the largest concurrency (see the
  JSON files: `max_requests`, `num_blocks`), and `--request-timeout-s {int(math.ceil(args.request_timeout))}`.
  The servers have no admission queue yet: with the default `--max-requests 4`, concurrency
  16 fails with "out of KV blocks", and with the default 60 s deadline (which counts the time
  a request waits for the worker) aggregated servers at concurrency 16 fail "generation did
  not finish before the deadline" on a busy machine.
- Interactivity = 1000 / mean TPOT (ms): output tokens per second one user sees. KV wait =
  the part of TTFT spent waiting for the KV, from decode's statistics in each response
  (`kvwire.transfer`): read mode, `load_wait_ms` (decode waiting for its READs); write mode,
  the larger of that and `tail_ms` (from the end of prefill's compute until the last pushed
  layer landed; prefill answers only once its writes are done, so this wait sits inside the
  prefill's time). As a check, the servers' `kvwire_dsv4_kv_load_wait_seconds_total` over the
  run counts decode's wait only (read mode: the same number; write mode: at most the first).
- Machine load before: `{before}`
- Machine load after: `{after}`
{"".join(f"- Note: {n}{chr(10)}" for n in notes)}
## Results

{total} requests, {failed} failed{"" if not errors else " (" + "; ".join(f"{n} x {c}" for c, n in errors.items()) + ")"},
{leaked} KV blocks still in use on the instances after the runs (each run waits up to 30 s
for every instance to return to zero). Same generated text (greedy) in every configuration:
{same_tokens(all_results)}.

{table(all_results)}

![throughput per instance against interactivity]({png_rel})

### Share of TTFT spent waiting for the KV (1P1D)

{kv_table(all_results)}

{defaults_section}The per-run JSON files (vLLM's key names: `request_throughput`, `output_throughput`,
`mean_ttft_ms`, `median_ttft_ms`, `p99_ttft_ms`, `mean_tpot_ms`, `mean_itl_ms`, ...) are in
`{os.path.relpath(args.out, ROOT)}/`.

## Reading it

This is a CPU toy model on a small shared machine: the numbers compare configurations with
each other in one run, not with GPUs, and on a busy machine (see the load lines) one run's
rows swing by several times, the concurrency-1 rows (few requests) most; rerun on a quiet
machine before drawing conclusions from small differences. Each server computes one token of
one request at a time (no batching), so throughput does not grow with concurrency the way a
GPU's does; higher concurrency mainly queues requests and raises TTFT. An aggregated server
computes a whole prompt between two decode steps of its other requests, so its TPOT grows
with concurrency; a 1P1D decode server only decodes, which is what disaggregation buys
(TPOT and interactivity), paid for with one prefill server's queue (TTFT).
"""
    with open(path, "w") as f:
        f.write(doc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.path.join(ROOT, "build/examples/dsv4/serve/kvwire-dsv4"))
    p.add_argument("--config", default=os.path.join(ROOT, "examples/dsv4/configs/tiny.json"),
                   help="model config (small.json is about 7x slower per token on a CPU)")
    p.add_argument("--weights", default=None,
                   help="default: <out>/<config>.safetensors, written once")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--runs", default="1:16,4:64,16:256",
                   help="concurrency:num_prompts pairs, one run each")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads-total", type=int, default=2)
    p.add_argument("--agg-instances", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=0, help="0: enough for --runs")
    p.add_argument("--request-timeout", type=float, default=900.0,
                   help="seconds per request, in the client and in the servers "
                        "(--request-timeout-s; their default 60 s counts time in the queue)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="reduced run for a busy machine: --runs 1:8,16:200")
    p.add_argument("--out", default=os.path.join(ROOT, "build/serve-bench"))
    p.add_argument("--doc", default=os.path.join(ROOT, "examples/dsv4/BENCHMARK.md"),
                   help="markdown to (re)write; '' for none")
    p.add_argument("--png", default=os.path.join(ROOT, "examples/dsv4/BENCHMARK-serving.png"))
    p.add_argument("--defaults-runs", default="16:64",
                   help="concurrency:num_prompts run(s) on the servers' default KV and "
                        "deadline settings ('' for none)")
    p.add_argument("--defaults-configs", default="aggregated,1P1D read tcp",
                   help="configurations of the --defaults-runs")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.bin, args.out, args.config = (os.path.abspath(x) for x in (args.bin, args.out,
                                                                     args.config))
    args.png = os.path.abspath(args.png)
    args.doc = os.path.abspath(args.doc) if args.doc else ""
    if args.quick:
        args.runs = "1:8,16:200"
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    if args.threads_total < 2 or args.threads_total % 2 or args.threads_total % args.agg_instances:
        p.error("--threads-total must be even and divisible by --agg-instances")
    try:
        parse_runs(args.runs)
        if args.defaults_runs:
            parse_runs(args.defaults_runs)
    except ValueError as e:
        p.error(str(e))
    unknown = [n.strip() for n in args.defaults_configs.split(",")
               if n.strip() and n.strip() not in CONFIGS]
    if unknown:
        p.error(f"unknown --defaults-configs {unknown}")
    if not os.access(args.bin, os.X_OK):
        p.error(f"{args.bin} is not built (ninja -C build kvwire-dsv4)")
    os.makedirs(args.out, exist_ok=True)
    cfg = os.path.splitext(os.path.basename(args.config))[0]
    weights = args.weights or os.path.join(args.out, f"{cfg}.safetensors")
    dsv4_cluster.ensure_weights(args.bin, args.config, weights)

    command = "/usr/bin/python3 perf/serve_bench/serve_compare.py " + " ".join(
        shlex.quote(os.path.relpath(a, ROOT) if a.startswith(ROOT + "/") else a)
        for a in (argv if argv is not None else sys.argv[1:]))
    before = uptime()
    notes = []
    if load1() >= 3:
        notes.append(f"the machine was busy when the run started (1-minute load "
                     f"{load1():.1f} >= 3): other work competed for the cores")
    print(f"load before: {before}", flush=True)
    t0 = time.monotonic()
    all_results: dict[str, list[dict]] = {}
    status = 0
    for name in names:
        try:
            all_results[name], note = run_config(name, args, weights, args.out, args.runs)
        except (dsv4_cluster.ClusterError, RuntimeError, OSError) as e:
            print(f"{name}: {e}", file=sys.stderr)
            notes.append(f"{name}: did not complete: {str(e).splitlines()[0]}")
            status = 1
            continue
        if note:
            notes.append(f"{name}: {note}")
            status = 1
        if any(r["failed"] or r["leaked_blocks"] or r.get("instances_unreachable")
               for r in all_results[name]):
            status = 1
    # The servers as they come (no admission queue yet): errors are expected and counted.
    defaults: dict[str, list[dict]] = {}
    for name in [n.strip() for n in args.defaults_configs.split(",") if n.strip()]:
        if not args.defaults_runs:
            break
        try:
            defaults[name], _ = run_config(name, args, weights, args.out, args.defaults_runs,
                                           server_defaults=True)
        except (dsv4_cluster.ClusterError, RuntimeError, OSError) as e:
            print(f"{name} (server defaults): {e}", file=sys.stderr)
            notes.append(f"{name} with the servers' defaults: did not complete: "
                         f"{str(e).splitlines()[0]}")
    after = uptime()
    print(f"load after: {after}", flush=True)
    why = bench_serve.plot(all_results, args.png,
                           f"{cfg}, {args.input_len}/{args.output_len} tokens, "
                           f"{args.threads_total} threads per configuration")
    if why:
        notes.append(f"no plot: {why}")
        print(f"plot: {why}", file=sys.stderr)
    print(table(all_results))
    print(f"same generated text in every configuration: {same_tokens(all_results)}")
    if args.doc:
        write_doc(args.doc, os.path.relpath(args.png, os.path.dirname(args.doc)), args, command,
                  before, after, all_results, defaults, notes, time.monotonic() - t0)
        print(f"wrote {args.doc}")
    return status


if __name__ == "__main__":
    sys.exit(main())
