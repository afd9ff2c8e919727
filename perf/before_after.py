#!/usr/bin/env python3
"""Rounds of the before/after benchmark set over two builds (perf/before_after.sh builds them).

Each round runs every case once with the BEFORE build and once with the AFTER build, the order
alternating round by round, so that both see the same machine; the table gives each case's
median over the rounds and the ratio after/before, and flags a change past --threshold in the
bad direction (printed only: a loaded box makes noise, and the reader judges it with the load).

Cases: kvwire-perf tcp and shm, WRITE and READ, at 64 KiB, 1 MiB and 4 MiB (the pool pattern
of `make compare`: a 1 GiB pool, -l 1 -t 8), GB/s; kvwire-transfer-driver (shm, 4 KiB WRITE):
allocations per transfer (process) and wall ns per transfer. --quick: 64 KiB and 1 MiB, WRITE
only, a 256 MiB pool and fewer ops.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare"))
from perf_target import wait_for_port  # noqa: E402

MIB = 1 << 20


def perf_case(bin_dir, transport, op, size, quick, tmp):
    """GB/s (average) of one kvwire-perf run: a target and an initiator on loopback."""
    perf = os.path.join(bin_dir, "perf", "kvwire-perf")
    pool = 256 if quick else 1024
    budget = (256 * MIB if quick else 1 << 30) * (1 if transport == "tcp" else 4)
    n = max(200, min(40000, budget // size))
    test = ["--transport", transport, "--op", op, "-s", str(size), "--pattern", "pool",
            "--pool-mib", str(pool), "-n", str(n), "-l", "1", "-t", "8"]
    target = subprocess.Popen([perf] + test + ["-p", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        port = wait_for_port(target, 400)
        out = os.path.join(tmp, "row.json")
        r = subprocess.run([perf] + test + ["-p", port, "--json", out, "127.0.0.1"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"kvwire-perf {' '.join(test)}: {r.stdout[-400:]}{r.stderr[-400:]}")
        with open(out) as f:
            return json.load(f)["results"][0]["bw_avg_gbs"]
    finally:
        try:
            target.wait(timeout=30)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()


def driver_case(bin_dir, quick):
    """{metric: value} of one kvwire-transfer-driver run."""
    driver = os.path.join(bin_dir, "perf", "kvwire-transfer-driver")
    n = "1000" if quick else "4000"
    r = subprocess.run([driver, "--n", n, "--warmup", "200", "--size", "4096", "--transport",
                        "shm", "--op", "write"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"kvwire-transfer-driver: {r.stdout[-400:]}{r.stderr[-400:]}")
    values = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            try:
                values[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return values


def cases(quick):
    """(name, unit, higher_is_better, thunk(bin_dir, tmp) -> value)."""
    out = []
    sizes = [64 << 10, 1 << 20] if quick else [64 << 10, 1 << 20, 4 << 20]
    ops = ["write"] if quick else ["write", "read"]
    for transport in ("tcp", "shm"):
        for op in ops:
            for size in sizes:
                name = f"perf {transport} {op.upper()} {size >> 10} KiB"
                out.append((name, "GB/s", True,
                            lambda b, tmp, t=transport, o=op, s=size: perf_case(b, t, o, s, quick,
                                                                                tmp)))
    out.append(("driver shm 4 KiB allocs/transfer", "allocs", False,
                lambda b, tmp: driver_case(b, quick).get("allocs_per_transfer_process",
                                                         float("nan"))))
    out.append(("driver shm 4 KiB wall ns/transfer", "ns", False,
                lambda b, tmp: driver_case(b, quick)["wall_ns_per_transfer"]))
    return out


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="build folder of the BEFORE revision")
    ap.add_argument("after", help="build folder of the AFTER revision")
    ap.add_argument("--runs", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--quick", action="store_true", help="a smaller, faster set")
    ap.add_argument("--threshold", type=float, default=0.10,
                    help="flag a change worse than this fraction (default 0.10)")
    ap.add_argument("--labels", default="before,after", help="column names")
    args = ap.parse_args()
    labels = args.labels.split(",")
    todo = cases(args.quick)
    values = {(name, side): [] for name, _, _, _ in todo for side in (0, 1)}
    failures = []
    print(f"load before: {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvwire-before-after-") as tmp:
        for rnd in range(args.runs):
            order = (0, 1) if rnd % 2 == 0 else (1, 0)
            for name, _, _, thunk in todo:
                for side in order:
                    try:
                        values[(name, side)].append(thunk((args.before, args.after)[side], tmp))
                    except Exception as e:  # one failed run: reported, the rest go on
                        failures.append(f"round {rnd + 1} {labels[side]} {name}: {e}")
            print(f"round {rnd + 1}/{args.runs} done (load {loadavg()})", file=sys.stderr,
                  flush=True)
    print(f"load after: {loadavg()}")
    print(f"median of {args.runs} rounds, {labels[0]} and {labels[1]} alternating; "
          f"flag: worse than {args.threshold:.0%}")
    print(f"{'case':<38} {'unit':<7} {labels[0]:>12} {labels[1]:>12} {'after/before':>13}  "
          f"{'spread (min..max) before | after':<36} flag")
    flagged = 0
    for name, unit, higher_better, _ in todo:
        b, a = values[(name, 0)], values[(name, 1)]
        if not b or not a:
            print(f"{name:<38} {unit:<7} {'-':>12} {'-':>12} {'-':>13}  no result")
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        ratio = ma / mb if mb else (1.0 if ma == mb else float("inf"))
        spread = f"{min(b):.3g}..{max(b):.3g} | {min(a):.3g}..{max(a):.3g}"
        worse = (ratio < 1 - args.threshold) if higher_better else (ratio > 1 + args.threshold)
        if unit == "allocs":
            worse = ma > mb + 0.5  # allocations: any whole new one per transfer counts
        flagged += worse
        print(f"{name:<38} {unit:<7} {mb:>12.3f} {ma:>12.3f} {ratio:>13.3f}  {spread:<36} "
              f"{'REGRESSION?' if worse else ''}")
    for f in failures:
        print(f"failed: {f}")
    print(f"{flagged} case(s) flagged" + (" (check them with more --runs on a quiet box)"
                                          if flagged else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
