#!/usr/bin/env python3
"""Mooncake's Transfer Engine (mooncake-transfer-engine-non-cuda) as a `make compare` peer:
its tcp protocol, host memory, two processes on loopback, metadata by its P2PHANDSHAKE (no
etcd). Runs in the compare virtual environment; see peer_common.py for the protocol and the
measurement loops, perf/compare/README.md for why this is fair to Mooncake.

Each side registers one buffer (register_memory). A batch is one batch_transfer_async_write /
_read call with the batch's local addresses, remote addresses and lengths (what SGLang's and
vLLM's Mooncake connectors call); the initiator waits for each batch with
get_batch_transfer_status (the engine's own completion wait). The engine's own threads serve
the target, whose main thread sleeps.
"""
import argparse
import os
import sys

import peer_common as pc


def make_engine():
    from mooncake.engine import TransferEngine  # the venv's; imported late for errors
    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) = {rc}")
    return engine


# Mooncake 0.3.13.post1's tcp transport queues at most 2,048 entries (more: "TCP lane
# queue-full" and the batch fails): a longer batch (the kv request's 2,550 ranges) goes as
# chunks of at most CHUNK entries, CHUNKS_IN_FLIGHT of them submitted at a time.
CHUNK = 1024
CHUNKS_IN_FLIGHT = 2


class Request:
    """One batch in flight: its chunks, submitted CHUNKS_IN_FLIGHT at a time."""

    def __init__(self, backend, chunks):
        self.backend = backend
        self.todo = list(chunks)
        self.inflight = []
        while self.todo and len(self.inflight) < CHUNKS_IN_FLIGHT:
            self._submit()

    def _submit(self):
        batch_id = self.backend.submit(self.backend.session, *self.todo.pop(0))
        if batch_id < 0:
            raise RuntimeError(f"mooncake batch submit returned {batch_id}")
        self.inflight.append(batch_id)

    def wait_one(self):
        # get_batch_transfer_status waits (GIL released, the engine polling) until every entry
        # of the batch completed; transfer_check_status looks at the batch's first entry only
        # in this release, so it would call a batch done early.
        rc = self.backend.engine.get_batch_transfer_status([self.inflight.pop(0)])
        if rc != 0:
            raise RuntimeError(f"mooncake get_batch_transfer_status = {rc}")
        if self.todo:
            self._submit()
        return not self.inflight


class Backend:
    def __init__(self, engine, session, local_addr, remote_addr, op):
        self.engine = engine
        self.session = session
        self.local_addr = local_addr
        self.remote_addr = remote_addr
        self.submit = (engine.batch_transfer_async_write if op == "WRITE"
                       else engine.batch_transfer_async_read)

    def prepare(self, ops):  # the three lists the batch call takes, built once per chunk
        return [([self.local_addr + l for l, _, _ in part],
                 [self.remote_addr + r for _, r, _ in part], [n for _, _, n in part])
                for part in (ops[i:i + CHUNK] for i in range(0, len(ops), CHUNK))]

    def post(self, chunks):
        return Request(self, chunks)

    def poll(self, request):
        return request.wait_one()


def main():
    ap = pc.add_options(argparse.ArgumentParser(description=__doc__))
    ap.add_argument("--transport", choices=["tcp"], default="tcp")
    args = ap.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO/WARNING lines on every connect
    try:
        buf = pc.Buffer(pc.buffer_bytes(args))
        engine = make_engine()
        rc = engine.register_memory(buf.addr, buf.size)
        if rc != 0:
            raise RuntimeError(f"register_memory({buf.size} bytes) = {rc}")
        if args.role == "target":
            pc.serve({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.addr})
            os._exit(0)
        target, info = pc.start_target([sys.executable, __file__, "target"] + sys.argv[2:])
    except Exception as e:  # noqa: BLE001 - the reason is the row
        pc.fail(f"mooncake setup: {type(e).__name__}: {e}")
    try:
        backend = Backend(engine, info["session"], buf.addr, info["addr"], args.op)
        result = pc.measure(backend, args)
        result["peer"] = "mooncake tcp"
        print(pc.json.dumps(result), flush=True)
    except Exception as e:  # noqa: BLE001
        pc.fail(f"mooncake {args.mode}: {type(e).__name__}: {e}")
    finally:
        pc.stop_target(target)
    os._exit(0)


if __name__ == "__main__":
    main()
