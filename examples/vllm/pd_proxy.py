"""A small proxy in vLLM's prefill/decode protocol, in front of one prefill and one decode
`vllm serve` (written here from the protocol, not from vLLM's toy proxy):

  read mode (NIXL's hand-off, and kvwire's default): the client's /v1/completions request goes
  to prefill with max_tokens 1, stream off and kv_transfer_params {do_remote_decode: true, the
  other fields null}; prefill's answer carries kv_transfer_params naming its blocks; the
  original request goes to decode with those, and decode's answer (streamed or not) goes back.
  write mode (kvwire's "mode": "write"): the proxy picks a transfer id and sends both at once:
  prefill {do_remote_decode, mode: write, transfer_id}, decode {do_remote_prefill, mode: write,
  transfer_id, remote_host/remote_port: the prefill worker's kvwire control address}; decode
  announces its blocks to prefill, prefill writes the KV into them.
  mooncake mode (vLLM's MooncakeConnector): both at once as well: prefill {do_remote_decode,
  transfer_id}, decode {do_remote_prefill, transfer_id, remote_engine_id, remote_bootstrap_addr:
  the prefill's bootstrap server}; decode pulls the KV.

Each answer carries header x-pd-prefill-ms (prefill's time); every upstream call has a deadline.

    python pd_proxy.py --prefill http://127.0.0.1:P --decode http://127.0.0.1:D --port N
        [--mode read|write --prefill-kv HOST:PORT]
"""
import argparse
import asyncio
import json
import secrets
import sys
import time

import aiohttp
from aiohttp import web

READ_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                       "remote_engine_id": None, "remote_block_ids": None,
                       "remote_host": None, "remote_port": None}


class Proxy:
    def __init__(self, prefill: str, decode: str, mode: str, prefill_kv: str,
                 timeout_s: float, prefill_engine_id: str = "prefill"):
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.mode = mode
        self.prefill_kv = prefill_kv
        self.prefill_engine_id = prefill_engine_id
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session = None

    async def start(self, app):
        self.session = aiohttp.ClientSession(timeout=self.timeout)

    async def stop(self, app):
        await self.session.close()

    async def _prefill(self, body: dict, params: dict) -> dict:
        req = dict(body)
        req.update(max_tokens=1, stream=False, kv_transfer_params=params)
        req.pop("stream_options", None)
        req.pop("max_completion_tokens", None)
        async with self.session.post(self.prefill + "/v1/completions", json=req) as r:
            text = await r.text()
            if r.status != 200:
                raise web.HTTPBadGateway(text=f"prefill answered {r.status}: {text[:500]}")
            return json.loads(text)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise web.HTTPBadRequest(text=f"request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="request body must be a JSON object")
        start = time.monotonic()
        prefill_task = None
        if self.mode == "read":
            answer = await self._prefill(body, dict(READ_PREFILL_PARAMS))
            params = answer.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise web.HTTPBadGateway(text=f"prefill gave no kv_transfer_params: {answer}")
            prefill_ms = (time.monotonic() - start) * 1e3
        elif self.mode == "write":
            tid = secrets.token_hex(16)
            host, _, port = self.prefill_kv.rpartition(":")
            prefill_task = asyncio.ensure_future(self._prefill(
                body, {"do_remote_decode": True, "mode": "write", "transfer_id": tid}))
            params = {"do_remote_prefill": True, "mode": "write", "transfer_id": tid,
                      "remote_host": host, "remote_port": int(port),
                      "remote_engine_id": self.prefill_engine_id}
            prefill_ms = -1.0
        else:  # mooncake
            tid = secrets.token_hex(16)
            prefill_task = asyncio.ensure_future(self._prefill(
                body, {"do_remote_decode": True, "transfer_id": tid}))
            params = {"do_remote_prefill": True, "transfer_id": tid,
                      "remote_engine_id": self.prefill_engine_id,
                      "remote_bootstrap_addr": f"http://{self.prefill_kv}"}
            prefill_ms = -1.0
        dreq = dict(body)
        dreq["kv_transfer_params"] = params
        try:
            async with self.session.post(self.decode + "/v1/completions", json=dreq) as r:
                resp = web.StreamResponse(status=r.status, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json"),
                    "x-pd-prefill-ms": f"{prefill_ms:.3f}"})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                if prefill_task is not None:
                    await prefill_task  # a failed prefill shows in the proxy's log
                await resp.write_eof()
                return resp
        finally:
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--mode", choices=("read", "write", "mooncake"), default="read")
    ap.add_argument("--prefill-kv", default="",
                    help="write mode: the prefill worker's kvwire control address host:port; "
                         "mooncake mode: the prefill's bootstrap server host:port")
    ap.add_argument("--prefill-engine-id", default="prefill")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args()
    if args.mode != "read" and ":" not in args.prefill_kv:
        sys.exit(f"--mode {args.mode} needs --prefill-kv HOST:PORT")
    proxy = Proxy(args.prefill, args.decode, args.mode, args.prefill_kv, args.timeout_s,
                  args.prefill_engine_id)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    web.run_app(app, host=args.host, port=args.port, print=lambda *_: None)


if __name__ == "__main__":
    main()
