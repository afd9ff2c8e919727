#!/usr/bin/python3
"""Serving benchmark for the kvwire-dsv4 servers, in the shape of `vllm bench serve`.

Sends streamed OpenAI /v1/completions requests to a server or to the P/D router, at a fixed
concurrency or request rate (a sweep when several concurrencies are given), and reports
TTFT, TPOT, ITL and end-to-end latency (mean, median, percentiles), request and output token
throughput, throughput per instance, and the share of TTFT spent waiting for the KV to
arrive at decode. The result JSON uses `vllm bench serve`'s key names where one exists
(request_throughput, output_throughput, mean_ttft_ms, median_ttft_ms, p99_ttft_ms, ...).

After each run it reads every instance's /health until no KV block is in use (the run is
over; held blocks must come back) and reports what stayed in use as leaked, and counts
failed requests by cause. Nothing is hidden: a failed request is in `failed` and
`errors_by_cause`, a leaked block in `leaked_blocks`.

Example (two instances behind a router, a sweep):
  bench_serve.py --base-url http://127.0.0.1:8000 --random-input-len 512 \
      --random-output-len 32 --num-prompts 200 --max-concurrency 1,4,16 \
      --save-result --result-dir out/ --plot out/sweep.png

Tokens: the dsv4 reference engine's tokenizer is byte-level (BOS + one token per byte), so a
random prompt of N tokens is BOS + N-1 random printable ASCII bytes, and a prompt from a
file has len(utf-8 bytes) + 1 tokens.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Any

try:
    import aiohttp
except ImportError:  # scripts/install-deps.sh installs python3-aiohttp
    sys.exit("bench_serve.py: Debian's python3-aiohttp is missing (scripts/install-deps.sh); "
             "run with /usr/bin/python3")

BOS_TOKENS = 1  # the byte tokenizer prepends BOS


# --- requests -----------------------------------------------------------------------------

@dataclasses.dataclass
class Sample:
    prompt: str
    prompt_len: int  # tokens, BOS included
    output_len: int  # max_tokens


def random_samples(num: int, input_len: int, output_len: int, seed: int,
                   range_ratio: float = 0.0) -> list[Sample]:
    """`num` prompts of random printable ASCII, lengths in [len*(1-r), len*(1+r)]."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(0x20, 0x7f)]

    def length(n):
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(num):
        n = length(input_len)
        text = "".join(rng.choice(alphabet) for _ in range(n - BOS_TOKENS))
        out.append(Sample(text, n, length(output_len)))
    return out


def file_samples(path: str, num: int, output_len: int) -> list[Sample]:
    """Prompts from a file, used in order and repeated to `num`.

    A .jsonl file has one object per line with "prompt" (a string) and optionally
    "output_len" (vLLM's custom dataset shape); any other file has one prompt per line.
    """
    prompts: list[tuple[str, int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise ValueError(f"{path}:{lineno}: needs a string \"prompt\"")
                n = obj.get("output_len", output_len)
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(f"{path}:{lineno}: \"output_len\" must be an integer >= 1")
                prompts.append((obj["prompt"], n))
            else:
                prompts.append((line, output_len))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return [Sample(p, len(p.encode()) + BOS_TOKENS, n)
            for p, n in (prompts[i % len(prompts)] for i in range(num))]


@dataclasses.dataclass
class Outcome:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter() when sent
    queue_time: float = 0.0  # waited for a concurrency slot
    error: str = ""
    cause: str = ""
    kv_wait_ms: float | None = None  # TTFT spent waiting for the KV (kv_wait_from)
    generated_text: str = ""


def error_cause(message: str) -> str:
    """Groups errors that differ only in ids and counts ("out of KV blocks: need N ...")."""
    m = re.sub(r"\b(rt-)?[0-9a-f]{8,}\b", "<id>", message)
    # Numbers standing alone (not inside a name like c4a, nor an HTTP status after "HTTP " or
    # "event ", which tells causes apart).
    m = re.sub(r"(?<![A-Za-z_\d])(?<!HTTP )(?<!event )\d+(?![A-Za-z_\d])", "N", m)
    return m[:160]


class SseEvents:
    """Server-sent events from bytes in any pieces: yields each event's data."""

    def __init__(self):
        self._buf = b""

    def feed(self, piece: bytes) -> list[str]:
        self._buf += piece.replace(b"\r\n", b"\n")
        events = []
        while b"\n\n" in self._buf:
            raw, self._buf = self._buf.split(b"\n\n", 1)
            data = [line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
            if data:
                events.append(b"\n".join(data).decode("utf-8", "replace"))
        return events


def kv_wait_from(transfer: dict) -> float | None:
    """The part of a request's TTFT spent waiting for its KV, from decode's statistics:
    read mode: load_wait_ms (decode waiting for its READs); write mode: the larger of that
    and tail_ms (from the end of prefill's compute until the last pushed layer landed at
    decode: prefill's answer waits for its writes, so this wait is inside prefill's time)."""
    def number(key):
        v = transfer.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    wait, tail = number("load_wait_ms"), number("tail_ms")
    if wait is None and tail is None:
        return None
    return max(wait or 0.0, tail or 0.0)


async def send_one(session: aiohttp.ClientSession, url: str, sample: Sample, model: str | None,
                   extra_body: dict, timeout_s: float) -> Outcome:
    out = Outcome(prompt_len=sample.prompt_len)
    # As vllm bench serve asks: OpenAI servers send usage in a last chunk only when asked.
    body = {"prompt": sample.prompt, "max_tokens": sample.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **extra_body}
    if model:
        body["model"] = model
    texts: list[str] = []
    done = False
    out.start_time = start = last = time.perf_counter()

    def fail(message: str):
        out.error = message
        out.cause = error_cause(message)

    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                text = await r.text(errors="replace")
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:300]
                fail(f"HTTP {r.status}: {message}")
                return out
            events = SseEvents()
            async for piece in r.content.iter_any():
                now = time.perf_counter()
                for data in events.feed(piece):
                    if data == "[DONE]":
                        done = True
                        continue
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        fail(f"event is not JSON: {data[:100]}")
                        return out
                    if not isinstance(obj, dict):
                        fail(f"event is not an object: {data[:100]}")
                        return out
                    if "error" in obj:
                        err = obj["error"]
                        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        code = err.get("code", "") if isinstance(err, dict) else ""
                        fail(f"error event {code}: {msg}".replace("  ", " "))
                        return out
                    choices = obj.get("choices") or [{}]
                    ids = choices[0].get("token_ids") or []
                    text = choices[0].get("text") or ""
                    if ids or text:
                        n = len(ids) if ids else 1
                        if out.output_tokens == 0:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.output_tokens += n
                        texts.append(text)
                    usage = obj.get("usage")
                    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                        out.prompt_len = usage["prompt_tokens"]  # the server's count wins
                    stats = obj.get("kvwire")
                    transfer = stats.get("transfer") if isinstance(stats, dict) else None
                    if isinstance(transfer, dict):
                        out.kv_wait_ms = kv_wait_from(transfer)
    except asyncio.TimeoutError:
        fail(f"no complete answer within --request-timeout {timeout_s:g} s")
        return out
    except aiohttp.ClientError as e:
        fail(f"connection: {type(e).__name__}: {e}")
        return out
    out.latency = time.perf_counter() - start
    out.generated_text = "".join(texts)
    if not done:
        fail("stream ended without [DONE]")
    elif out.output_tokens == 0:
        fail("stream had no tokens")
    else:
        out.success = True
    return out


# --- instances: /metrics and /health --------------------------------------------------------

def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> sum over its label sets."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            continue
    return sums


async def get_json(session, url, timeout_s=10.0):
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"GET {url}: HTTP {r.status}: {text[:200]}")
        return json.loads(text)


async def scrape(session, base: str) -> dict[str, float]:
    try:
        async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return {}
            return parse_prometheus(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


def as_url(address: str) -> str:
    return address if address.startswith("http") else f"http://{address}"


async def discover_instances(session, base_urls: list[str]) -> list[str]:
    """The model servers behind `base_urls`: a router's /health lists its prefill and decode
    servers; any other server is an instance itself."""
    found: list[str] = []
    for base in base_urls:
        h = await get_json(session, base + "/health")
        if h.get("role") == "router":
            listed = [a.get("address", "") if isinstance(a, dict) else a
                      for kind in ("prefill", "decode") for a in (h.get(kind) or [])]
            listed = [a for a in listed if isinstance(a, str) and a]
            if not listed:
                # Without them there is no leak check and no per-instance throughput.
                raise RuntimeError(f"router {base}: /health lists no prefill or decode "
                                   "server; name them with --instance")
            found += [as_url(a) for a in listed]
        else:
            found.append(base)
    return [u.rstrip("/") for u in dict.fromkeys(found) if u]


async def settle(session, instances: list[str], timeout_s: float) -> list[dict]:
    """Waits (up to timeout_s) until no instance holds a KV block, then reports each one."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = []
        for base in instances:
            try:
                h = await get_json(session, base + "/health")
                if "used_blocks" not in h:
                    # Without it nothing says whether the instance gave its blocks back.
                    raise ValueError("no used_blocks in the answer")
                report.append({"url": base, "role": h.get("role"),
                               "used_blocks": int(h["used_blocks"]),
                               "held_blocks": int(h.get("held_blocks", 0)),
                               "live_connector_requests": int(h.get("live_connector_requests", 0)),
                               "active_requests": int(h.get("active_requests", 0)),
                               "held_requests": int(h.get("held_requests", 0))})
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError,
                    TypeError) as e:
                # Unknown, not zero: counted in instances_unreachable (a --strict failure).
                report.append({"url": base, "error": f"/health: {e}", "used_blocks": -1})
        busy = [r for r in report if "error" in r or r["used_blocks"] != 0
                or r.get("held_blocks") or r.get("live_connector_requests")
                or r.get("held_requests") or r.get("active_requests")]
        if not busy or time.monotonic() >= deadline:
            return report
        await asyncio.sleep(0.2)


# --- statistics -----------------------------------------------------------------------------

def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def mean(values):
    return sum(values) / len(values) if values else 0.0


def std(values):
    if not values:
        return 0.0
    m = mean(values)
    return math.sqrt(sum((x - m) ** 2 for x in values) / len(values))


def summarize(name: str, values_s: list[float], percentiles: list[float], result: dict):
    ms = [v * 1000.0 for v in values_s]
    result[f"mean_{name}_ms"] = mean(ms)
    result[f"median_{name}_ms"] = percentile(ms, 50)
    result[f"std_{name}_ms"] = std(ms)
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        result[f"p{word}_{name}_ms"] = percentile(ms, p)


def compute_metrics(outcomes: list[Outcome], duration: float, percentiles: list[float],
                    num_instances: int) -> dict:
    ok = [o for o in outcomes if o.success]
    failed = [o for o in outcomes if not o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    r: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": None,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    summarize("ttft", [o.ttft for o in ok], percentiles, r)
    summarize("tpot", tpots, percentiles, r)
    summarize("itl", [x for o in ok for x in o.itl], percentiles, r)
    summarize("e2el", [o.latency for o in ok], percentiles, r)
    # Peak output tokens in any one-second bucket, and peak concurrency (as vLLM reports).
    if ok:
        t0 = min(o.start_time for o in ok)
        buckets: dict[int, int] = {}
        events = []
        for o in ok:
            t = o.start_time + o.ttft
            times = [t]
            for x in o.itl:
                t += x
                times.append(t)
            for t in times:
                buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
            events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
        peak = cur = 0
        for _, d in sorted(events):
            cur += d
            peak = max(peak, cur)
        r["max_output_tokens_per_s"] = float(max(buckets.values()))
        r["max_concurrent_requests"] = peak
    else:
        r["max_output_tokens_per_s"] = 0.0
        r["max_concurrent_requests"] = 0
    # Per instance, and InferenceX's interactivity (tokens/s seen by one user = 1 / TPOT).
    r["num_instances"] = num_instances
    r["output_throughput_per_instance"] = r["output_throughput"] / max(1, num_instances)
    r["request_throughput_per_instance"] = r["request_throughput"] / max(1, num_instances)
    r["interactivity_tok_s_user"] = 1000.0 / r["mean_tpot_ms"] if r["mean_tpot_ms"] > 0 else 0.0
    # KV wait (the prefill's KV on its way to decode), per request from decode's stats.
    waits = [o.kv_wait_ms for o in ok if o.kv_wait_ms is not None]
    r["kv_wait_reported"] = len(waits)
    if waits:
        summarize("kv_wait", [w / 1000.0 for w in waits], percentiles, r)
        ttft_sum = sum(o.ttft for o in ok if o.kv_wait_ms is not None) * 1000.0
        r["kv_wait_share_of_ttft"] = sum(waits) / ttft_sum if ttft_sum > 0 else 0.0
    else:
        r["kv_wait_share_of_ttft"] = None
    causes: dict[str, int] = {}
    for o in failed:
        causes[o.cause] = causes.get(o.cause, 0) + 1
    r["errors_by_cause"] = dict(sorted(causes.items(), key=lambda kv: -kv[1]))
    return r


# --- a run ----------------------------------------------------------------------------------

class Progress:
    """A one-line progress bar on a terminal (stderr); silent otherwise."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.monotonic()

    def update(self, ok: bool):
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        el = time.monotonic() - self.t0
        rate = self.done / el if el > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{self.done}/{self.total} {rate:.2f} req/s, {self.failed} failed, "
                         f"eta {eta:.0f} s ")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


def arrival_delays(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (s from the start): all at once for rate inf, else gamma-distributed gaps
    (Poisson at burstiness 1), scaled so the last one is at n / rate."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    scale = (n / rate) / out[-1] if out and out[-1] > 0 else 1.0
    return [x * scale for x in out]


async def run_benchmark(base_urls: list[str], samples: list[Sample], *, concurrency: int | None,
                        request_rate: float = math.inf, burstiness: float = 1.0,
                        endpoint: str = "/v1/completions", model: str | None = None,
                        extra_body: dict | None = None, percentiles=(50, 90, 99),
                        instances: list[str] | None = None, num_instances: int | None = None,
                        request_timeout: float = 600.0, settle_timeout: float = 30.0,
                        warmup: int = 1, progress: bool = True, label: str = "",
                        seed: int = 0) -> dict:
    """One run; returns the result dictionary (vLLM's keys plus kvwire's)."""
    base_urls = [u.rstrip("/") for u in base_urls]
    extra_body = extra_body or {}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        if instances is None:
            instances = await discover_instances(session, base_urls)
        instances = [u.rstrip("/") for u in instances]
        n_inst = num_instances or len(instances) or 1
        # Warm-up requests (connections between prefill and decode are made on the first
        # request): a failure here is a setup error, not a benchmark result.
        for i in range(warmup):
            for base in base_urls:
                w = await send_one(session, base + endpoint, samples[i % len(samples)], model,
                                   extra_body, request_timeout)
                if not w.success:
                    raise RuntimeError(f"warm-up request to {base} failed: {w.error}")
        before = {u: await scrape(session, u) for u in instances}
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        bar = Progress(len(samples), label or f"c={concurrency or 'inf'}", progress)
        delays = arrival_delays(len(samples), request_rate, burstiness, random.Random(seed))

        async def one(i: int, sample: Sample, arrival: float) -> Outcome:
            url = base_urls[i % len(base_urls)] + endpoint
            if sem is None:
                o = await send_one(session, url, sample, model, extra_body, request_timeout)
            else:
                async with sem:
                    queued = time.perf_counter() - arrival
                    o = await send_one(session, url, sample, model, extra_body, request_timeout)
                    o.queue_time = queued
            bar.update(o.success)
            return o

        t0 = time.perf_counter()
        tasks = []
        for i, (s, d) in enumerate(zip(samples, delays)):
            wait = t0 + d - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, s, time.perf_counter())))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        after = {u: await scrape(session, u) for u in instances}
        health = await settle(session, instances, settle_timeout)

    r = compute_metrics(outcomes, duration, list(percentiles), n_inst)
    # Server-side view: the KV wait counters of every instance over the run, against the sum
    # of the TTFTs the clients saw (works when responses carry no per-request statistics).
    per_instance = []
    wait_s = 0.0
    for u, h in zip(instances, health):
        b, a = before.get(u, {}), after.get(u, {})

        def delta(name):
            return a.get(name, 0.0) - b.get(name, 0.0)

        w = delta("kvwire_dsv4_kv_load_wait_seconds_total")
        wait_s += w
        per_instance.append({**h,
                             "requests_ok": delta("kvwire_dsv4_requests_ok_total"),
                             "requests_error": delta("kvwire_dsv4_requests_error_total"),
                             "generated_tokens": delta("kvwire_dsv4_generated_tokens_total"),
                             "kv_load_wait_s": w})
    ttft_total = sum(o.ttft for o in outcomes if o.success)
    r["kv_wait_share_of_ttft_metrics"] = wait_s / ttft_total if ttft_total > 0 else None
    r["instances"] = per_instance
    # Blocks in use and blocks held for a reader that never came; an instance that did not
    # answer /health is not "0 leaked" but unknown: instances_unreachable.
    r["leaked_blocks"] = sum(max(0, i["used_blocks"]) + max(0, i.get("held_blocks", 0))
                             for i in per_instance)
    r["instances_unreachable"] = sum(1 for i in per_instance if "error" in i)
    r["input_lens"] = [o.prompt_len for o in outcomes]
    r["output_lens"] = [o.output_tokens if o.success else 0 for o in outcomes]
    r["ttfts"] = [o.ttft for o in outcomes]
    r["itls"] = [o.itl for o in outcomes]
    r["latencies"] = [o.latency for o in outcomes]
    r["start_times"] = [o.start_time for o in outcomes]
    r["queue_times"] = [o.queue_time for o in outcomes]
    r["errors"] = [o.error for o in outcomes]
    r["kv_wait_ms"] = [o.kv_wait_ms for o in outcomes]
    r["generated_texts"] = [o.generated_text for o in outcomes]
    return r


DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
            "queue_times", "errors", "kv_wait_ms", "generated_texts")


def print_summary(r: dict, percentiles) -> None:
    line = "{:<42} {:<10}".format
    fline = "{:<42} {:<10.2f}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=54, c="="))
    print(line("Successful requests:", r["completed"]))
    print(line("Failed requests:", r["failed"]))
    for cause, n in r["errors_by_cause"].items():
        print(f"  {n} x {cause}")
    print(line("Maximum request concurrency:", str(r.get("max_concurrency"))))
    print(fline("Benchmark duration (s):", r["duration"]))
    print(line("Total input tokens:", r["total_input_tokens"]))
    print(line("Total generated tokens:", r["total_output_tokens"]))
    print(fline("Request throughput (req/s):", r["request_throughput"]))
    print(fline("Output token throughput (tok/s):", r["output_throughput"]))
    print(fline("Total token throughput (tok/s):", r["total_token_throughput"]))
    print(fline(f"Output tok/s per instance ({r['num_instances']}):",
                r["output_throughput_per_instance"]))
    print(fline("Interactivity (tok/s/user):", r["interactivity_tok_s_user"]))
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"),
                        ("kv_wait", "KV wait")):
        if f"mean_{name}_ms" not in r:
            continue
        print("{s:{c}^{n}}".format(s=title, n=54, c="-"))
        print(fline(f"Mean {title} (ms):", r[f"mean_{name}_ms"]))
        print(fline(f"Median {title} (ms):", r[f"median_{name}_ms"]))
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            print(fline(f"P{word} {title} (ms):", r[f"p{word}_{name}_ms"]))
    share = r.get("kv_wait_share_of_ttft")
    share_m = r.get("kv_wait_share_of_ttft_metrics")
    print(line("KV wait share of TTFT (responses):",
               "n/a" if share is None else f"{100 * share:.1f}%"))
    print(line("KV wait share of TTFT (/metrics):",
               "n/a" if share_m is None else f"{100 * share_m:.1f}%"))
    print(line("Blocks in use after the run:", r["leaked_blocks"]))
    if r.get("instances_unreachable"):
        print(line("Instances without /health after the run:", r["instances_unreachable"]))
    print("=" * 54)


# --- plot -----------------------------------------------------------------------------------

COLORS = ("#000000", "#1f77b4", "#2ca02c", "#d62728", "#ff7f0e", "#9467bd", "#8c564b")


def plot(series: dict[str, list[dict]], png: str, title: str) -> str | None:
    """Throughput per instance against interactivity, one line per configuration, each point
    labelled with its concurrency. Returns why not when gnuplot is missing."""
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        return "gnuplot is not installed (scripts/install-deps.sh --compare installs gnuplot-nox)"
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-plot-") as data_dir:
        plots = []
        script = [
            "set terminal pngcairo size 1000,640 noenhanced font ',11'" if _has_cairo(gnuplot)
            else "set terminal png size 1000,640 noenhanced",
            f"set output '{png}'",
            f"set title '{title}'",
            "set xlabel 'interactivity (output tokens/s per user = 1000 / mean TPOT ms)'",
            "set ylabel 'output tokens/s per instance'",
            "set grid", "set key outside right top",
            "set offsets graph 0.05, graph 0.05, graph 0.05, graph 0.05",
            "set xrange [0:*]", "set yrange [0:*]",
        ]
        for i, (name, runs) in enumerate(series.items()):
            pts = sorted((r["interactivity_tok_s_user"], r["output_throughput_per_instance"],
                          r.get("max_concurrency") or 0) for r in runs if r["completed"] > 0)
            if not pts:
                continue
            path = os.path.join(data_dir, f"{i}.dat")
            with open(path, "w") as f:
                for x, y, c in pts:
                    f.write(f"{x} {y} {c}\n")
            color = COLORS[i % len(COLORS)]
            plots.append(f"'{path}' using 1:2 with linespoints lw 2 pt {5 + 2 * (i % 5)} ps 1.3 "
                         f"lc rgb '{color}' title '{name}'")
            plots.append(f"'{path}' using 1:2:(sprintf('c=%d', $3)) with labels offset 0,1 "
                         "font ',8' notitle")
        if not plots:
            return "no completed runs to plot"
        script.append("plot " + ", ".join(plots))
        p = subprocess.run([gnuplot], input="\n".join(script), text=True, capture_output=True,
                           timeout=60)
    if p.returncode != 0:
        return f"gnuplot failed: {p.stderr.strip()[:300]}"
    return None


def _has_cairo(gnuplot: str) -> bool:
    p = subprocess.run([gnuplot, "-e", "set terminal"], capture_output=True, text=True,
                       timeout=30)
    return "pngcairo" in (p.stdout + p.stderr)


# --- command line ---------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", action="append", default=None,
                   help="server or router URL (http://host:port); repeat to spread requests "
                        "round robin over several (data-parallel instances)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None)
    p.add_argument("--dataset-name", choices=("random", "custom"), default="random")
    p.add_argument("--dataset-path", default=None,
                   help="prompts: .jsonl with \"prompt\" (and \"output_len\"), or one per line")
    p.add_argument("--random-input-len", "--input-len", type=int, default=256,
                   help="prompt tokens, BOS included")
    p.add_argument("--random-output-len", "--output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", default=None,
                   help="one number, or a comma-separated list for a sweep (one run each)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (Poisson arrivals at --burstiness 1); default: all at once")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--metric-percentiles", default="90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--settle-timeout", type=float, default=30.0,
                   help="seconds to wait after a run for every instance to free its blocks")
    p.add_argument("--instance", action="append", default=None,
                   help="a model server to read /health and /metrics from (default: the "
                        "router's prefill and decode servers, or --base-url itself)")
    p.add_argument("--num-instances", type=int, default=None,
                   help="instances to divide throughput by (default: the instances found)")
    p.add_argument("--extra-body", default=None, help="JSON merged into every request")
    p.add_argument("--label", default="kvwire-dsv4")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true",
                   help="keep per-request lists (ttfts, itls, errors, ...) in the JSON")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None,
                   help="file name for one run (a sweep appends -concurrencyN)")
    p.add_argument("--plot", default=None, help="PNG: throughput per instance vs interactivity")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a request failed, a block stayed in use (or held), or "
                        "an instance did not answer /health after the run")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.request_rate <= 0 or args.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    try:
        args.concurrencies = ([int(c) for c in args.max_concurrency.split(",")]
                              if args.max_concurrency else [None])
        args.percentiles = [float(x) for x in args.metric_percentiles.split(",") if x]
        args.extra = json.loads(args.extra_body) if args.extra_body else {}
    except ValueError as e:
        p.error(f"bad value: {e}")
    if any(c is not None and c < 1 for c in args.concurrencies):
        p.error("--max-concurrency values must be >= 1")
    if any(not 0 < q < 100 for q in args.percentiles):
        p.error("--metric-percentiles must be in (0, 100)")
    if not isinstance(args.extra, dict):
        p.error("--extra-body must be a JSON object")
    if args.dataset_name == "custom" and not args.dataset_path:
        p.error("--dataset-name custom needs --dataset-path")
    if not args.base_url:
        args.base_url = [f"http://{args.host}:{args.port}"]
    return args


def result_path(args, concurrency) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    c = f"-concurrency{concurrency}" if concurrency else ""
    if args.result_filename:
        root, ext = os.path.splitext(args.result_filename)
        name = f"{root}{c}{ext}" if len(args.concurrencies) > 1 else args.result_filename
    else:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        name = f"{args.label}-{rate}qps{c}-{stamp}.json"
    return os.path.join(args.result_dir, name)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.dataset_name == "custom":
            samples = file_samples(args.dataset_path, args.num_prompts, args.random_output_len)
        else:
            samples = random_samples(args.num_prompts, args.random_input_len,
                                     args.random_output_len, args.seed, args.random_range_ratio)
    except (OSError, ValueError) as e:
        print(f"bench_serve.py: {e}", file=sys.stderr)
        return 2
    runs = []
    bad = False
    for c in args.concurrencies:
        try:
            r = asyncio.run(run_benchmark(
                args.base_url, samples, concurrency=c, request_rate=args.request_rate,
                burstiness=args.burstiness, endpoint=args.endpoint, model=args.model,
                extra_body=args.extra, percentiles=args.percentiles, instances=args.instance,
                num_instances=args.num_instances, request_timeout=args.request_timeout,
                settle_timeout=args.settle_timeout, warmup=args.num_warmups,
                progress=not args.disable_tqdm, label=f"{args.label} c={c or 'inf'}",
                seed=args.seed))
        except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            print(f"bench_serve.py: {e}", file=sys.stderr)
            return 2
        result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai",
                  "backend": "openai", "label": args.label, "model_id": args.model,
                  "tokenizer_id": None, "num_prompts": args.num_prompts,
                  "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                  "burstiness": args.burstiness, "max_concurrency": c,
                  "base_urls": args.base_url, **r}
        print_summary(result, args.percentiles)
        bad = (bad or result["failed"] > 0 or result["leaked_blocks"] > 0
               or result["instances_unreachable"] > 0)
        if not args.save_detailed:
            for k in DETAILED:
                result.pop(k, None)
        if args.save_result:
            os.makedirs(args.result_dir, exist_ok=True)
            path = result_path(args, c)
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
            print(f"wrote {path}")
        runs.append(result)
    if args.plot:
        why = plot({args.label: runs}, args.plot, f"{args.label}: throughput vs interactivity")
        print(f"plot: {why}" if why else f"wrote {args.plot}")
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
