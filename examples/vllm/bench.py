"""Side by side on this machine's CPU: the same tiny model served disaggregated (a prefill and a
decode `vllm serve`, pd_proxy.py in front, read mode) with kvwire (tcp, shm), NixlConnector
(kv_buffer_device cpu) and, where it installs, MooncakeConnector; one run, one table.

Per connector, at concurrency 1 and 8, streamed /v1/completions through the proxy:
  TTFT      client-side time to the first streamed token (prefill + hand-off + first decode step)
  hand-off  TTFT minus the prefill's own answer time (the proxy's x-pd-prefill-ms): the KV
            transfer plus decode's one-token step; measured the same way for every connector,
            as their own transfer counters differ in what they count
  tok/s     generated tokens per second of wall time of the whole batch

    python examples/vllm/bench.py [--out examples/vllm/BENCH.md] [--connectors kvwire-tcp,...]
(make vllm-bench). The box is shared and tiny: the numbers compare connectors within one run.
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving  # noqa: E402
import tiny_model  # noqa: E402

PROMPT_TOKENS, MAX_TOKENS = 256, 16


def connector_config(name: str, kv_port: int, side: str) -> tuple:
    """(kv_transfer_config, extra environment) of one server; side is prefill or decode."""
    if name.startswith("kvwire-"):
        transport = name.split("-", 1)[1]
        # shm moves vLLM's CPU cache (plain process memory) by cross-memory attach: opt-in.
        return (serving.kvwire_config(transport, kv_port if side == "prefill" else 0,
                                      mode="read"),
                {"KVWIRE_SHM_CMA": "1"} if transport == "shm" else {})
    if name == "nixl":
        return ({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                 "kv_buffer_device": "cpu"},
                {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(serving.free_port()),
                 "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_TLS": "tcp,self,sm"})
    if name == "mooncake":
        # The prefill's bootstrap server listens on kv_port (decode's on a port of its own).
        return ({"kv_connector": "MooncakeConnector", "engine_id": f"mooncake-{side}",
                 "kv_role": "kv_producer" if side == "prefill" else "kv_consumer",
                 "kv_buffer_device": "cpu",
                 "kv_connector_extra_config": {"mooncake_protocol": "tcp"}},
                {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(kv_port if side == "prefill"
                                                     else serving.free_port())})
    raise ValueError(f"unknown connector {name}")


def one_request(url: str, prompt: list) -> dict:
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    start = time.monotonic()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"proxy answered {resp.status}: {resp.read()[:300]!r}")
    prefill_ms = float(resp.getheader("x-pd-prefill-ms", "-1"))
    ttft, tokens = None, 0
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        if event.get("choices") and event["choices"][0].get("text") is not None:
            if ttft is None:
                ttft = (time.monotonic() - start) * 1e3
            tokens += 1
    conn.close()
    if ttft is None:
        raise RuntimeError("the stream carried no token (the decode's load failed?)")
    return {"ttft_ms": ttft, "prefill_ms": prefill_ms, "handoff_ms": ttft - prefill_ms,
            "tokens": tokens}


def try_request(url: str, prompt: list) -> dict:
    """one_request, with a failure as a result (counted in the row) rather than an abort."""
    try:
        return one_request(url, prompt)
    except Exception as e:  # noqa: BLE001 - every failure is counted and its first one shown
        return {"error": str(e)[:200]}


def run_phase(url: str, concurrency: int, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, tiny_model.VOCAB) for _ in range(PROMPT_TOKENS)]
               for _ in range(n)]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: try_request(url, p), prompts))
    wall = time.monotonic() - start
    ok = [r for r in results if "error" not in r]
    failed = [r["error"] for r in results if "error" in r]
    med = lambda k: statistics.median(r[k] for r in ok) if ok else float("nan")  # noqa: E731
    return {"ttft_ms": med("ttft_ms"), "handoff_ms": med("handoff_ms"),
            "tok_s": sum(r["tokens"] for r in ok) / wall, "n": n, "failed": len(failed),
            "first_error": failed[0] if failed else ""}


def bench_connector(name: str, model: str, logs: str, start_timeout_s: float) -> dict:
    kv_port = serving.free_port()
    procs = []
    try:
        servers = []
        for side in ("prefill", "decode"):
            cfg, env = connector_config(name, kv_port, side)
            e = serving.server_env()
            e.update(env)
            s = serving.VllmServer(f"bench-{name}-{side}", model, logs, cfg, env=e)
            procs.append(s)
            servers.append(s)
        for s in servers:
            s.wait_ready(start_timeout_s)
        if name == "mooncake":
            proxy = serving.PdProxy(f"bench-{name}-proxy", servers[0], servers[1], logs,
                                    "mooncake", f"127.0.0.1:{kv_port}", "mooncake-prefill")
        else:
            proxy = serving.PdProxy(f"bench-{name}-proxy", servers[0], servers[1], logs)
        procs.append(proxy)
        proxy.wait_ready()
        one_request(proxy.url, [5] * PROMPT_TOKENS)  # warm-up (first-call costs)
        return {"c1": run_phase(proxy.url, 1, 8, 1), "c8": run_phase(proxy.url, 8, 32, 2)}
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connectors", default="kvwire-tcp,kvwire-shm,nixl,mooncake")
    ap.add_argument("--out", default="")
    ap.add_argument("--start-timeout-s", type=float, default=600)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="kvwire-vllm-bench-")
    logs = os.environ.get("KVWIRE_VLLM_LOG_DIR") or tmp.name
    model = tiny_model.write_model(os.path.join(tmp.name, "model"), "llama")
    rows = []
    for name in args.connectors.split(","):
        try:
            r = bench_connector(name, model, logs, args.start_timeout_s)
            failed = r["c1"]["failed"] + r["c8"]["failed"]
            note = "" if not failed else (
                f" ({failed} of {r['c1']['n'] + r['c8']['n']} failed: "
                f"{(r['c1']['first_error'] or r['c8']['first_error']).replace('|', '/')})")
            rows.append(f"| {name}{note} | {r['c1']['ttft_ms']:.1f} | {r['c1']['handoff_ms']:.1f} | "
                        f"{r['c1']['tok_s']:.1f} | {r['c8']['ttft_ms']:.1f} | "
                        f"{r['c8']['handoff_ms']:.1f} | {r['c8']['tok_s']:.1f} |")
        except Exception as e:  # noqa: BLE001 - a connector that does not serve is a row too
            lines = str(e).strip().splitlines()
            # The root cause: the first "...Error: ..." line of the server's log tail that is
            # not a wrapper (later ones are often the shutdown's own).
            # vLLM wraps a worker's error ("Engine core initialization failed", "Worker failed
            # with error ..."): the first line that is neither is the cause.
            wrappers = ("Engine core initialization failed", "Worker failed with error")
            errors = [ln.strip() for ln in lines if "Error:" in ln]
            errors = [ln for ln in errors if not any(w in ln for w in wrappers)] or errors
            why = (errors[0] if errors else lines[0] if lines else repr(e))[:300]
            rows.append(f"| {name} | did not serve: {why.replace('|', '/')} | | | | | |")
        print(rows[-1], flush=True)
    table = "\n".join([
        f"Prompt {PROMPT_TOKENS} tokens, {MAX_TOKENS} generated, greedy; tiny Llama (2 layers, "
        "hidden 64, float32), vLLM CPU backend; medians. `make vllm-bench` regenerates it.", "",
        "| connector | TTFT c=1 (ms) | hand-off c=1 (ms) | tok/s c=1 | TTFT c=8 (ms) | "
        "hand-off c=8 (ms) | tok/s c=8 |",
        "|---|---|---|---|---|---|---|"] + rows) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
