"""What every peer driver of `make compare` shares (perf/compare/README.md, "The peers").

A peer driver (nixl_peer.py, mooncake_peer.py) runs in the compare virtual environment as
`python DRIVER.py run OPTIONS`: it starts its own target as a child process (`DRIVER.py target
OPTIONS`), which registers its buffer and prints one JSON line (what the initiator needs to
reach it), then waits until its standard input closes. The initiator measures and prints one
JSON line with the result; compare.py reads that line.

A driver supplies a Backend: `post(batch)` starts one batch (a list of (local offset, remote
offset, length)) prepared by `prepare(ops)`, `poll(token)` says whether it is done (raising on
an error). The measurement loops below are the same for every peer, so each one is driven the
same way:
  bw   D batches of L ops in flight, reposted as each completes, over a byte budget (hot: the
       same block on both sides; pool: blocks in random order over a pool on each side);
  lat  one op in flight: post, busy-poll to completion, one sample per op (p50, p99);
  kv   one request's ranges (kvwire-perf --dump-ranges) as one batch, one request at a time.
"""
import argparse
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import time

DEADLINE_S = 300  # every wait: a peer that stops completing is an error, not a hang


def add_options(ap):
    ap.add_argument("role", choices=["run", "target"])
    ap.add_argument("--mode", choices=["bw", "lat", "kv"], default="bw")
    ap.add_argument("--op", choices=["WRITE", "READ"], default="WRITE")
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--pattern", choices=["hot", "pool"], default="hot")
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=1 << 30, help="bw: bytes measured")
    ap.add_argument("--batch", type=int, default=0,
                    help="bw: ops per batch (0: max(4, 1 MiB / size))")
    ap.add_argument("--depth", type=int, default=2, help="bw: batches in flight")
    ap.add_argument("--iters", type=int, default=2000, help="lat: ops; kv: requests")
    ap.add_argument("--ranges", default="", help="kv: kvwire-perf --dump-ranges file")
    return ap


def read_ranges(path):
    """(buffer bytes, request bytes, pages before merge, [(src, dst, len)])."""
    with open(path) as f:
        head = f.readline().split()
        if len(head) != 5 or head[0] != "kvwire-kv-ranges":
            raise ValueError(f"{path}: not a kvwire-perf --dump-ranges file")
        buffer_bytes, count, request_bytes, pages = (int(x) for x in head[1:])
        ranges = []
        for line in f:
            src, dst, length = (int(x) for x in line.split())
            if src + length > buffer_bytes or dst + length > buffer_bytes:
                raise ValueError(f"{path}: range {src} {dst} {length} past {buffer_bytes}")
            ranges.append((src, dst, length))
    if len(ranges) != count:
        raise ValueError(f"{path}: {len(ranges)} ranges, header says {count}")
    return buffer_bytes, request_bytes, pages, ranges


def buffer_bytes(args):
    if args.mode == "kv":
        return read_ranges(args.ranges)[0]
    return args.pool_mib << 20 if args.pattern == "pool" else args.size


class Buffer:
    """Page-aligned anonymous memory, every page written once (both sides fault in before
    anything is measured, as kvwire-perf's buffers are filled)."""

    def __init__(self, size):
        self.size = size
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        page = b"\x5a" * min(size, 1 << 20)
        for off in range(0, size, len(page)):
            n = min(len(page), size - off)
            self.map[off:off + n] = page[:n]
        import ctypes  # the address of the mapping, for registration
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))


def serve(info):
    """Target: print what the initiator needs, then wait for standard input to close."""
    print(json.dumps(info), flush=True)
    sys.stdin.read()


def start_target(argv, env=None):
    """Starts `argv` (a driver in the target role); returns (process, its JSON line)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read()
        proc.wait()
        raise RuntimeError(f"target exited ({proc.returncode}) before it was ready: {err[-800:]}")
    return proc, json.loads(line)


def stop_target(proc):
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def batch_size(args):
    return args.batch if args.batch > 0 else max(4, (1 << 20) // args.size)


def bw_batches(args):
    """The batches of one pass: hot reuses block 0 on both sides; pool covers every block of
    the pool once, in random order, local and remote blocks drawn independently."""
    per = batch_size(args)
    if args.pattern == "hot":
        return [[(0, 0, args.size)] * per]
    blocks = (args.pool_mib << 20) // args.size
    rng = random.Random(0x6b76)
    local = list(range(blocks))
    remote = list(range(blocks))
    rng.shuffle(local)
    rng.shuffle(remote)
    ops = [(l * args.size, r * args.size, args.size) for l, r in zip(local, remote)]
    return [ops[i:i + per] for i in range(0, len(ops) - per + 1, per)]


def wait_done(backend, token):
    deadline = time.monotonic() + DEADLINE_S
    while not backend.poll(token):
        if time.monotonic() > deadline:
            raise TimeoutError(f"a batch did not complete in {DEADLINE_S} s")


def measure_bw(backend, args):
    batches = bw_batches(args)
    # A batch is reposted only after it completed: at least `depth` distinct ones (hot: the
    # same ops, prepared `depth` times).
    batches = batches * -(-args.depth // len(batches))
    prepared = [backend.prepare(b) for b in batches]
    per_batch = sum(op[2] for op in batches[0])
    warm = len(prepared) if args.pattern == "pool" else 2 * args.depth
    total = warm + max(args.depth, args.budget // per_batch)

    inflight = []
    started = None
    done = 0
    deadline = time.monotonic() + DEADLINE_S
    for i in range(total):
        if len(inflight) == args.depth:
            token = inflight.pop(0)
            wait_done(backend, token)
            done += 1
            if done == warm:
                started = time.perf_counter()
        inflight.append(backend.post(prepared[i % len(prepared)]))
        if time.monotonic() > deadline:
            raise TimeoutError(f"bw run over {DEADLINE_S} s")
    for token in inflight:
        wait_done(backend, token)
    seconds = time.perf_counter() - started
    moved = (total - warm) * per_batch
    return {"gbs": moved / seconds / 1e9, "seconds": seconds, "bytes": moved,
            "batch": len(batches[0]), "depth": args.depth}


def percentile(sorted_values, pct):
    k = min(len(sorted_values) - 1, max(0, round(pct / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def measure_lat(backend, args):
    batch = backend.prepare([(0, 0, args.size)])
    samples = []
    warm = max(100, args.iters // 10)
    for i in range(warm + args.iters):
        t0 = time.perf_counter()
        wait_done(backend, backend.post(batch))
        if i >= warm:
            samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return {"p50_us": percentile(samples, 50), "p99_us": percentile(samples, 99),
            "avg_us": statistics.fmean(samples), "n": len(samples)}


def measure_kv(backend, args):
    _, request_bytes, pages, ranges = read_ranges(args.ranges)
    # WRITE: this side is prefill (source); READ: this side is decode, reading prefill's.
    ops = [(s, d, n) if args.op == "WRITE" else (d, s, n) for s, d, n in ranges]
    batch = backend.prepare(ops)
    ms = []
    for i in range(2 + args.iters):
        t0 = time.perf_counter()
        wait_done(backend, backend.post(batch))
        if i >= 2:
            ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    med = statistics.median(ms)
    return {"request_ms": med, "p99_ms": percentile(ms, 99), "avg_ms": statistics.fmean(ms),
            "us_per_page": med * 1e3 / pages, "pages": pages, "ranges": len(ranges),
            "bytes": request_bytes, "n": len(ms)}


def measure(backend, args):
    result = {"bw": measure_bw, "lat": measure_lat, "kv": measure_kv}[args.mode](backend, args)
    result.update(mode=args.mode, op=args.op)
    return result


def fail(message):
    """One JSON line saying why, for compare.py's row; exit status 1."""
    print(json.dumps({"error": message}), flush=True)
    sys.exit(1)
