#!/usr/bin/python3
"""A vLLM-style disaggregated-serving proxy in front of kvwire-dsv4 prefill and decode servers.

The proxy below speaks exactly the protocol of vLLM's P/D proxies (its toy_proxy_server and
disagg_proxy_demo): the client's request goes to prefill with

    kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
                         "remote_engine_id": null, "remote_block_ids": null,
                         "remote_host": null, "remote_port": null}
    max_tokens: 1, stream: false (stream_options removed, min_tokens popped)

then the original request, with the kv_transfer_params of prefill's JSON answer (and
min_tokens/min_completion_tokens put back as null), goes to decode and decode's bytes are
streamed back. No other field is added: no first token travels.

The test checks, for prompts crossing the 4-token (c4 compression), 128-token (window and c128
compression) and 256-token (compressed page) boundaries, that the streamed tokens through the
proxy equal those of an aggregated ("both") server, in completions and chat form, seeded
sampling with vLLM's filters and penalties, then stop
strings, include_usage, token-id prompts and GET /v1/models, and that both servers give every
KV block back.

Usage: vllm_proxy_test.py --bin kvwire-dsv4 --config tiny.json
Runs under Debian's /usr/bin/python3 (python3-aiohttp, python3-httpx).
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp
from aiohttp import web
import httpx

MAX_TOKENS = 8
# BOS + bytes: a prompt of n - 1 characters runs n tokens.
LENGTHS = [1, 4, 5, 128, 129, 256, 257]
DEADLINE_S = 60


def prompt_of_tokens(n):
    return "".join(chr(ord("a") + (i * 7 + n) % 26) for i in range(n - 1))


# --- the proxy (vLLM's protocol, nothing kvwire-specific) -------------------------------------


class Proxy:
    """Round-robins nothing: one prefill and one decode, as the toy proxy with one of each."""

    def __init__(self, prefill, decode):
        self.prefill = f"http://{prefill}"
        self.decode = f"http://{decode}"
        self.port = None
        self.session = None
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.thread.start()
        if not self.ready.wait(DEADLINE_S) or self.port is None:
            raise RuntimeError("proxy did not start")

    def stop(self):
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        fut.result(DEADLINE_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(DEADLINE_S)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.ready.set()  # start() sees port None when serving failed
        self.loop.run_forever()

    async def _serve(self):
        timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
        self.session = aiohttp.ClientSession(timeout=timeout)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _shutdown(self):
        await self.session.close()
        await self.runner.cleanup()

    async def _completions(self, request):
        api = request.path
        req_data = await request.json()
        # Prefill: exactly what vLLM's toy proxy sends.
        p = dict(req_data)
        p["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        p["stream"] = False
        p["max_tokens"] = 1
        if "max_completion_tokens" in p:
            p["max_completion_tokens"] = 1
        p.pop("stream_options", None)
        p.pop("min_tokens", None)
        p.pop("min_completion_tokens", None)
        async with self.session.post(self.prefill + api, json=p) as r:
            body = await r.read()
            if r.status != 200:
                return web.Response(status=r.status, body=body, content_type="application/json")
            prefill_json = json.loads(body)
        kv_transfer_params = prefill_json.get("kv_transfer_params", {})
        d = dict(req_data)
        if kv_transfer_params:
            d["kv_transfer_params"] = kv_transfer_params
        d["min_tokens"] = None
        d["min_completion_tokens"] = None
        # Decode: streamed back byte for byte.
        resp = web.StreamResponse(status=200)
        resp.content_type = "application/json"
        async with self.session.post(self.decode + api, json=d) as r:
            resp.set_status(r.status)
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
        await resp.write_eof()
        return resp


# --- servers -----------------------------------------------------------------------------------


class Servers:
    def __init__(self, binary, config):
        self.binary = binary
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="kvwire-vllm-proxy-")
        self.weights = os.path.join(self.dir, "tiny.safetensors")
        self.procs = {}

    def run_weights(self):
        subprocess.run(
            [self.binary, "weights", "--config", self.config, "--out", self.weights],
            check=True, timeout=120, stdout=subprocess.DEVNULL)

    def serve(self, name, role):
        return self.launch(name, [
            "serve", "--role", role, "--config", self.config, "--weights", self.weights,
            "--transport", "tcp", "--mode", "auto", "--threads", "2",
            "--request-timeout-s", "20", "--peer-lease-ms", "2000"])

    def router(self, name, prefill, decode, mode):
        return self.launch(name, ["router", "--prefill", prefill, "--decode", decode, "--mode",
                                  mode, "--timeout-s", "60"])

    def launch(self, name, args):
        ready = os.path.join(self.dir, name + ".ready")
        log = open(os.path.join(self.dir, name + ".log"), "w")
        args = [self.binary] + args + ["--ready-file", ready]
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = (p, log)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if os.path.exists(ready):
                with open(ready) as f:
                    try:
                        return json.load(f)["address"]
                    except ValueError:
                        pass
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited {p.returncode}:\n{self.log(name)}")
            time.sleep(0.02)
        raise RuntimeError(f"{name} not ready in time:\n{self.log(name)}")

    def log(self, name):
        with open(os.path.join(self.dir, name + ".log")) as f:
            return f.read()[-3000:]

    def stop(self):
        """SIGTERM each server; True when all stopped cleanly (exit 0)."""
        clean = True
        for name, (p, log) in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            log.close()
            if p.returncode != 0:
                print(f"{name} did not stop cleanly ({p.returncode}):\n{self.log(name)}")
                clean = False
        return clean


# --- client ------------------------------------------------------------------------------------


def stream(address, path, body):
    """POSTs a streamed request; returns (token ids, text, finish_reason, events)."""
    tokens, text, reason, events = [], "", None, []
    with httpx.stream("POST", f"http://{address}{path}", json=body, timeout=DEADLINE_S) as r:
        if r.status_code != 200:
            raise AssertionError(f"{path} -> {r.status_code}: {r.read()[:300]}")
        buf = ""
        for piece in r.iter_text():
            buf += piece
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                if not event.startswith("data: "):
                    continue
                data = event[len("data: "):]
                if data == "[DONE]":
                    events.append(data)
                    continue
                j = json.loads(data)
                events.append(j)
                if "error" in j:
                    raise AssertionError(f"{path}: error event {j}")
                for c in j.get("choices", []):
                    tokens += c.get("token_ids", [])
                    text += c.get("text", "") or c.get("delta", {}).get("content", "")
                    reason = c.get("finish_reason") or reason
    return tokens, text, reason, events


def post(address, path, body):
    r = httpx.post(f"http://{address}{path}", json=body, timeout=DEADLINE_S)
    return r.status_code, r.json()


def wait_drained(address, what):
    deadline = time.monotonic() + 40
    last = None
    while time.monotonic() < deadline:
        last = httpx.get(f"http://{address}/health", timeout=10).json()
        if (last["used_blocks"] == 0 and last["live_connector_requests"] == 0
                and last["active_requests"] == 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} still holds blocks: {last}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    servers = Servers(args.bin, args.config)
    proxy = None
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)
            print("FAIL:", what)

    try:
        servers.run_weights()
        prefill = servers.serve("prefill", "prefill")
        decode = servers.serve("decode", "decode")
        whole = servers.serve("both", "both")
        started = Proxy(prefill, decode)
        started.start()
        proxy = started  # stopped at the end (a proxy that did not start is a daemon thread)
        via = f"127.0.0.1:{proxy.port}"

        # Completions, streamed, across the compression and window boundaries.
        answers = {}
        for n in LENGTHS:
            body = {"model": "dsv4-tiny", "prompt": prompt_of_tokens(n),
                    "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0}
            want = stream(whole, "/v1/completions", body)
            got = stream(via, "/v1/completions", body)
            check(len(want[0]) == MAX_TOKENS, f"{n} tokens: aggregated gave {want[0]}")
            check(got[0] == want[0], f"{n} tokens: proxy {got[0]} != aggregated {want[0]}")
            check(got[1] == want[1], f"{n} tokens: text {got[1]!r} != {want[1]!r}")
            answers[n] = want[0]
            print(f"prompt of {n} tokens: {got[0]}")

        # Seeded sampling with every filter and penalty: the proxy's tokens are the aggregated
        # server's (decode samples every token with the seed, as the aggregated server does).
        seeded = {"model": "dsv4-tiny", "prompt": prompt_of_tokens(130),
                  "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0.9,
                  "top_p": 0.95, "top_k": 50, "min_p": 0.02, "presence_penalty": 0.4,
                  "frequency_penalty": 0.3, "repetition_penalty": 1.2, "ignore_eos": True,
                  "seed": 4242}
        want = stream(whole, "/v1/completions", seeded)
        got = stream(via, "/v1/completions", seeded)
        check(len(want[0]) == MAX_TOKENS and got[0] == want[0],
              f"seeded: proxy {got[0]} != aggregated {want[0]}")

        # Chat, streamed with include_usage: the role first, the usage chunk last.
        chat = {"model": "dsv4-tiny", "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}, "max_completion_tokens": MAX_TOKENS,
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": prompt_of_tokens(130)}]}
        want = stream(whole, "/v1/chat/completions", chat)
        got = stream(via, "/v1/chat/completions", chat)
        check(got[0] == want[0] and len(got[0]) == MAX_TOKENS,
              f"chat: proxy {got[0]} != aggregated {want[0]}")
        events = [e for e in got[3] if e != "[DONE]"]
        check(events[0]["object"] == "chat.completion.chunk", f"chat chunk: {events[0]}")
        check(events[0]["choices"][0]["delta"].get("role") == "assistant",
              f"first chat chunk has no role: {events[0]}")
        check(events[-1]["choices"] == [] and
              events[-1]["usage"]["completion_tokens"] == MAX_TOKENS,
              f"no usage chunk last: {events[-1]}")
        check(got[3][-1] == "[DONE]", "chat stream did not end with [DONE]")

        # Not streamed, with a stop string taken from an answer above: two printable bytes after
        # the first token (the model's bytes need not be text). The answer ends before the
        # first place they occur.
        picked = None
        for n, toks in answers.items():
            for i in range(1, len(toks) - 1):
                if all(32 <= t < 127 for t in toks[:i + 2]):
                    picked = (n, toks, i)
                    break
            if picked:
                break
        check(picked is not None, f"no answer with two printable bytes to stop at: {answers}")
        if picked:
            n, toks, i = picked
            stop = bytes(toks[i:i + 2]).decode()
            first = bytes(toks).find(stop.encode())
            status, cut = post(via, "/v1/completions", {"prompt": prompt_of_tokens(n),
                                                        "max_tokens": MAX_TOKENS,
                                                        "temperature": 0,
                                                        "stop": [stop, "never-seen"]})
            check(status == 200, f"stop via proxy: {status} {cut}")
            choice = cut["choices"][0]
            check(choice["token_ids"] == toks[:first] and
                  choice["text"] == bytes(toks[:first]).decode() and
                  choice["finish_reason"] == "stop",
                  f"stop {stop!r} over {toks}: {choice}")

        # A prompt given as token ids runs as given (the same tokens as its text with BOS).
        ids = [256] + [ord(c) for c in prompt_of_tokens(128)]
        want = stream(whole, "/v1/completions",
                      {"prompt": prompt_of_tokens(128), "max_tokens": MAX_TOKENS, "stream": True,
                       "temperature": 0})
        got = stream(via, "/v1/completions",
                     {"prompt": ids, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0})
        check(got[0] == want[0], f"token-id prompt: {got[0]} != {want[0]}")
        answers_ids = want[0]

        # The bundled router speaks the same protocol (read mode), and keeps write mode's own
        # path (decode prepares its blocks first): chat, token ids and stop through both.
        for mode in ("read", "write"):
            router = servers.router("router-" + mode, prefill, decode, mode)
            got = stream(router, "/v1/chat/completions", chat)
            want = stream(whole, "/v1/chat/completions", chat)
            check(got[0] == want[0], f"chat via {mode} router: {got[0]} != {want[0]}")
            check(got[3][-2]["usage"]["completion_tokens"] == MAX_TOKENS,
                  f"{mode} router: no usage chunk: {got[3][-2:]}")
            got = stream(router, "/v1/completions",
                         {"prompt": ids, "max_tokens": MAX_TOKENS, "stream": True,
                          "temperature": 0})
            check(got[0] == answers_ids, f"token ids via {mode} router: {got[0]}")
            r = httpx.get(f"http://{router}/v1/models", timeout=10)
            check(r.status_code == 200 and r.json()["data"][0]["id"] == "dsv4-tiny",
                  f"{mode} router /v1/models: {r.status_code} {r.text[:200]}")

        # What the servers cannot do is refused, by name.
        status, err = post(via, "/v1/completions", {"prompt": "x", "n": 2})
        check(status == 400 and "'n'" in err["error"]["message"], f"n=2: {status} {err}")
        r = httpx.get(f"http://{decode}/v1/models", timeout=10).json()
        check(r["data"][0]["id"] == "dsv4-tiny", f"/v1/models: {r}")

        wait_drained(prefill, "prefill")
        wait_drained(decode, "decode")
    except Exception as e:  # noqa: BLE001 - reported as the failure it is
        failures.append(f"{type(e).__name__}: {e}")
        print("FAIL:", failures[-1])
    finally:
        if proxy is not None:
            proxy.stop()
        if not servers.stop():
            failures.append("a server did not stop cleanly")
    if failures:
        print(f"{len(failures)} failure(s); logs in {servers.dir}")
        for name in servers.procs:
            print(f"--- {name}\n{servers.log(name)}")
        return 1
    shutil.rmtree(servers.dir, ignore_errors=True)
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
