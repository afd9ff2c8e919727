#!/usr/bin/env python3
"""Side-by-side comparison of kvwire-perf with its floors and peers, in one run.

Measures, alternating the tools in every round (median of --runs rounds, decimal GB/s):
  floors   memcpy (kvwire-memcpy-floor: same sizes and buffer patterns), iperf3 on loopback
  peers    ucx_perftest (Debian's ucx-utils): tag_bw, ucp_put_bw, ucp_get over UCX_TLS=tcp;
           ucp_put_bw, ucp_get over posix shared memory; UCT cma zero-copy put_bw and get
  kvwire   kvwire-perf over tcp and shm, WRITE and READ, hot and pool buffer patterns
at 64 KiB, 1 MiB and 4 MiB (and the dsv4-pro 8k-token request when the kv workload exists).
Prints one table of medians with ratios, writes a gnuplot PNG and perf/RESULTS.md.
ucx_perftest prints MB/s meaning MiB/s: converted to decimal GB/s here.

  perf/compare/compare.py --bin build/perf          (what `make compare` runs)
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from perf_target import wait_for_port

import peers as peer_libs

SIZES = [64 << 10, 1 << 20, 4 << 20]
# The dsv4-pro request of kvwire-perf's kv workload; kvwire-memcpy-floor copies the same
# ranges (the same options build the same plans) for the shm request's floor.
KV_REQUEST = ["--workload", "kv", "--layout", "dsv4-pro", "--prompt", "8192", "--frag", "0.5",
              "--requests", "1"]
POOL_MIB = 1024
KIB = 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def size_name(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


class Runner:
    def __init__(self, args):
        self.args = args
        self.perf = os.path.join(args.bin, "kvwire-perf")
        self.floor = os.path.join(args.bin, "kvwire-memcpy-floor")
        self.tmp = tempfile.mkdtemp(prefix="kvwire-compare-")
        self.env = dict(os.environ, KVWIRE_LOG_LEVEL="error")
        self.pool_mib = POOL_MIB

    # --- floors -------------------------------------------------------------------------
    def memcpy(self, size, pattern):
        n = max(200, min(20000, (4 << 30) // size))
        out = subprocess.run([self.floor, "-s", str(size), "--pattern", pattern, "--pool-mib",
                              str(POOL_MIB), "-n", str(n)], capture_output=True, text=True,
                             check=True, timeout=300).stdout
        return float(out.split()[-1])

    def memcpy_kv(self):
        """ms of memcpy of one dsv4-pro request's ranges between two memfd pools (what the shm
        transport copies between), median of 20: measured apart from kvwire-perf."""
        out = subprocess.run([self.floor] + KV_REQUEST + ["-n", "20", "--floor-memory", "memfd"],
                             capture_output=True, text=True, check=True, timeout=300).stdout
        fields = out.split()
        if len(fields) < 6 or fields[0] != "memcpy-kv":
            raise RuntimeError(f"kvwire-memcpy-floor kv: unexpected output {out[-300:]!r}")
        return float(fields[4])

    def iperf3(self, size):
        port = free_port()
        server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(50):
                r = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "2",
                                    "-l", str(min(size, 1 << 20)), "-J"],  # iperf3: -l <= 1M
                                   capture_output=True, text=True,
                                   timeout=60)
                try:
                    data = json.loads(r.stdout)
                    return data["end"]["sum_received"]["bits_per_second"] / 8e9
                except (ValueError, KeyError):  # not listening yet
                    pass
                time.sleep(0.1)
            raise RuntimeError("iperf3: " + r.stdout[-300:] + r.stderr[-300:])
        finally:
            server.kill()
            server.wait()

    # --- ucx_perftest -------------------------------------------------------------------
    def ucx(self, test, tls, size, uct=None, tool=None, latency=False):
        """GB/s of the "Final:" line; latency: one op outstanding (-O 1), its typical latency
        (us) as {"p50_us": ...}.
        tool: (ucx_perftest, its lib folder) of another UCX than Debian's."""
        port = free_port()
        budget = (1 << 30) if tls == "tcp" else (4 << 30)
        n = max(1000, min(200000, budget // size))
        if latency:
            n = 2000
        env = dict(os.environ, UCX_TLS=tls)
        perftest = "ucx_perftest"
        if tool is not None:
            perftest = tool[0]
            env["LD_LIBRARY_PATH"] = tool[1]
        extra = []
        if uct is not None:  # UCT-level test: transport and device named, zero-copy
            env.pop("UCX_TLS")
            extra = ["-x", uct, "-d", "memory", "-D", "zcopy"]
        server = subprocess.Popen([perftest, "-p", str(port)] + extra, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(50):
                r = subprocess.run([perftest, "127.0.0.1", "-p", str(port), "-t", test,
                                    "-s", str(size), "-n", str(n), "-w", str(max(100, n // 10))]
                                   + extra + (["-O", "1"] if latency else []), env=env, capture_output=True, text=True, timeout=300)
                final = [l for l in r.stdout.splitlines() if l.startswith("Final:")]
                if final and latency:
                    return {"p50_us": float(final[0].split()[2])}  # typical latency
                if final:
                    return float(final[0].split()[6]) * 1048576 / 1e9  # overall MiB/s
                if "Connection refused" not in r.stdout + r.stderr:
                    raise RuntimeError(f"ucx_perftest {test} {tls}: {r.stdout[-400:]} {r.stderr[-400:]}")
                time.sleep(0.1)
            raise RuntimeError("ucx_perftest: server did not start")
        finally:
            server.kill()
            server.wait()

    # --- kvwire-perf --------------------------------------------------------------------
    def kvwire(self, transport, op, size=None, pattern="hot", kv=False, latency=False):
        """The initiator's JSON row; latency: one transfer of one op in flight (-t 1 -l 1)."""
        test = ["--transport", transport, "--op", op]
        if latency:
            test += ["-s", str(size), "-n", "300" if self.args.quick else "3000", "-w", "200",
                     "-l", "1", "-t", "1"]
        elif kv:
            test += KV_REQUEST + ["-n", "20"]
        else:
            n = max(400, min(40000, ((1 << 30) if transport == "tcp" else (4 << 30)) // size))
            test += ["-s", str(size), "--pattern", pattern, "--pool-mib", str(POOL_MIB),
                     "-n", str(n), "-l", str(self.args.batch), "-t", str(self.args.depth)]
        if transport == "tcp":
            test += ["-q", str(self.args.qps)]
        target = subprocess.Popen([self.perf] + test + ["-p", "0"], env=self.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            port = wait_for_port(target, 600)
            out = os.path.join(self.tmp, "kv.json")
            cmd = [self.perf] + test + ["-p", port, "--json", out, "127.0.0.1"]
            r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise RuntimeError(f"kvwire-perf {' '.join(test)}: {r.stdout[-600:]}{r.stderr[-600:]}")
            with open(out) as f:
                row = json.load(f)["results"][0]
            return row
        finally:
            try:
                target.wait(timeout=30)
            except subprocess.TimeoutExpired:
                target.kill()
                target.wait()


def measurements(args, have_kv):
    """(key, label, group, thunk) for every measurement of one round."""
    m = []
    for size in SIZES:
        for pattern in ("hot", "pool"):
            m.append((("memcpy", pattern, size), lambda r, s=size, p=pattern: r.memcpy(s, p)))
        m.append((("iperf3", "-", size), lambda r, s=size: r.iperf3(s)))
        for test, name in (("tag_bw", "ucx tcp tag_bw"), ("ucp_put_bw", "ucx tcp put"),
                           ("ucp_get", "ucx tcp get")):
            m.append(((name, "hot", size), lambda r, s=size, t=test: r.ucx(t, "tcp", s)))
        for test, name in (("ucp_put_bw", "ucx posix put"), ("ucp_get", "ucx posix get")):
            m.append(((name, "hot", size),
                      lambda r, s=size, t=test: r.ucx(t, "posix,self", s)))
        for test, name in (("put_bw", "ucx cma put zcopy"), ("get", "ucx cma get zcopy")):
            m.append(((name, "hot", size), lambda r, s=size, t=test: r.ucx(t, None, s, "cma")))
        for transport in ("tcp", "shm"):
            for op in ("write", "read"):
                for pattern in ("hot", "pool"):
                    m.append(((f"kvwire {transport} {op.upper()}", pattern, size),
                              lambda r, s=size, t=transport, o=op, p=pattern:
                              r.kvwire(t, o, s, p)["bw_avg_gbs"]))
    if have_kv:
        m.append((("memcpy dsv4-pro 8k", "pool", "request"), lambda r: r.memcpy_kv()))
        for transport in ("tcp", "shm"):
            for op in ("read", "write"):
                m.append(((f"kvwire {transport} dsv4-pro 8k {op.upper()}", "pool", "request"),
                          lambda r, t=transport, o=op: r.kvwire(t, o, kv=True)))
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bin", default="build/perf", help="folder with kvwire-perf")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="kvwire-perf -l (--post_list)")
    ap.add_argument("--depth", type=int, default=8, help="kvwire-perf -t")
    ap.add_argument("--qps", type=int, default=1, help="kvwire-perf -q over tcp")
    ap.add_argument("--results", default="perf/RESULTS.md")
    ap.add_argument("--plot", default="perf/RESULTS-bandwidth.png")
    ap.add_argument("--venv", default="build/venv-compare",
                    help="the peers' virtual environment (scripts/compare-venv.sh)")
    ap.add_argument("--quick", action="store_true",
                    help="smaller peer budgets and fewer latency samples: checks the pipeline "
                         "end to end, not a result to publish")
    ap.add_argument("--only", default="",
                    help="regex: run only the measurements whose name matches (a check)")
    args = ap.parse_args()
    runner = Runner(args)
    peers = peer_libs.Peers(args, runner)

    probe = subprocess.Popen([runner.perf, "--workload", "kv", "-p", "0"], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:  # without the connector's layouts the target exits at once with that reason
        have_kv = "needs the connector" not in probe.communicate(timeout=20)[0]
    except subprocess.TimeoutExpired:  # waiting for an initiator: the kv workload exists
        have_kv = True
        probe.kill()
        probe.communicate()
    todo = measurements(args, have_kv) + peer_libs.measurements(peers, SIZES, have_kv)
    if args.only:
        todo = [(key, thunk) for key, thunk in todo if re.search(args.only, key[0])]
    values = {key: [] for key, _ in todo}
    failures = {}
    started = time.time()
    load_before = os.getloadavg()[0]
    for run in range(args.runs):
        for i, (key, thunk) in enumerate(todo):
            print(f"\r[round {run + 1}/{args.runs}] {i + 1}/{len(todo)} {key[0]} {key[1]} "
                  f"{key[2]}".ljust(78), end="", file=sys.stderr, flush=True)
            try:
                values[key].append(thunk(runner))
            except Exception as e:  # a failed tool is reported, the others still run
                print(f"\n{key}: {e}", file=sys.stderr)
                failures[key] = str(e).replace("\n", " ")
    print(file=sys.stderr)
    med = {}
    for key, v in values.items():
        if not v:
            continue
        if isinstance(v[0], dict):  # kv and latency rows: the median row by its time
            v = sorted(v, key=lambda row: row.get("lat_avg_us", row.get("request_ms",
                                                                        row.get("p50_us", 0))))
            med[key] = v[len(v) // 2]
        else:
            med[key] = statistics.median(v)
    report = render(args, med, have_kv, time.time() - started)
    peer_lines, peer_goals = peer_libs.render(peers, med, SIZES, have_kv, failures)
    report["table"] += "\n\n" + "\n".join(peer_lines)
    report["goals"] += peer_goals
    report["peers"] = peers.versions()
    load_after = os.getloadavg()[0]
    report["load"] = (f"Load average {load_before:.1f} before and {load_after:.1f} after the run "
                      f"on {os.cpu_count()} cores (a shared machine).")
    if max(load_before, load_after) > (os.cpu_count() or 1):
        report["load"] += (" Other work was running: every figure is perturbed, ucx_perftest's "
                           "busy-polling ones most; compare ratios, and rerun when quieter.")
    print(report["table"])
    plot(args, med)
    write_results(args, report)


def render(args, med, have_kv, seconds):
    def g(name, pattern, size):
        return med.get((name, pattern, size))

    def fmt(v):
        return "   -  " if v is None else f"{v:6.2f}"

    lines = []
    head = f"{'measurement (decimal GB/s, median)':<34} {'pattern':<7}" + "".join(
        f" {size_name(s):>8}" for s in SIZES)
    lines.append(head)
    lines.append("-" * len(head))
    names = ["memcpy", "iperf3", "ucx tcp tag_bw", "ucx tcp put", "ucx tcp get",
             "ucx posix put", "ucx posix get", "ucx cma put zcopy", "ucx cma get zcopy"]
    names += [f"kvwire {t} {o}" for t in ("tcp", "shm") for o in ("WRITE", "READ")]
    for name in names:
        for pattern in ("hot", "pool", "-"):
            vals = [g(name, pattern, s) for s in SIZES]
            if all(v is None for v in vals):
                continue
            lines.append(f"{name:<34} {pattern:<7}" + "".join(f" {fmt(v):>8}" for v in vals))
    lines.append("")
    lines.append(f"{'ratio':<34} {'pattern':<7}" + "".join(f" {size_name(s):>8}" for s in SIZES)
                 + "   goal")
    lines.append("-" * (len(head) + 8))
    goals = []

    def ratio_row(label, pattern, num, den, goal, ceiling=None):
        """`ceiling`: for a floor (memcpy of the same buffers), a ratio above it is a
        measurement to doubt, not a goal met."""
        vals = []
        for s in SIZES:
            a, b = num(s), den(s)
            vals.append(None if a is None or b in (None, 0) else a / b)
        met = all(v is not None and v >= goal for v in vals) if goal else None
        suspect = ceiling is not None and any(v is not None and v > ceiling for v in vals)
        if suspect:
            met = False
        mark = "" if goal is None else (
            f"  >= {goal:.2f} " + ("MISSED (above its floor: suspect measurement)" if suspect
                                   else "met" if met else "MISSED"))
        lines.append(f"{label:<34} {pattern:<7}" + "".join(
            f" {('   -  ' if v is None else f'{v:6.2f}x'):>8}" for v in vals) + mark)
        if goal:
            goals.append((label, pattern, vals, goal, met))

    def best_tcp(s):
        vals = [g(n, "hot", s) for n in ("ucx tcp tag_bw", "ucx tcp put", "ucx tcp get")]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    for op in ("WRITE", "READ"):
        ratio_row(f"kvwire tcp {op} / best tcp peer", "hot",
                  lambda s, o=op: g(f"kvwire tcp {o}", "hot", s), best_tcp, 1.1)
    for op in ("WRITE", "READ"):
        ratio_row(f"kvwire tcp {op} / iperf3", "hot",
                  lambda s, o=op: g(f"kvwire tcp {o}", "hot", s),
                  lambda s: g("iperf3", "-", s), None)
    for op, peer in (("WRITE", "ucx posix put"), ("READ", "ucx posix get")):
        ratio_row(f"kvwire shm {op} / {peer}", "hot",
                  lambda s, o=op: g(f"kvwire shm {o}", "hot", s),
                  lambda s, p=peer: g(p, "hot", s), 1.0)
    for op in ("WRITE", "READ"):
        for pattern in ("hot", "pool"):
            ratio_row(f"kvwire shm {op} / memcpy", pattern,
                      lambda s, o=op, p=pattern: g(f"kvwire shm {o}", p, s),
                      lambda s, p=pattern: g("memcpy", p, s), 0.9, ceiling=1.1)
    kv_lines = []
    if have_kv:
        for t in ("tcp", "shm"):
            for op in ("READ", "WRITE"):
                row = med.get((f"kvwire {t} dsv4-pro 8k {op}", "pool", "request"))
                if row is None:  # failed in every round (its errors were printed above)
                    kv_lines.append(f"dsv4-pro 8k request {op:<5} {t}: not measured (failed in "
                                    "every round), goal <= 1.25x MISSED")
                    continue
                # shm: kvwire-memcpy-floor's memcpy of the same ranges, measured apart;
                # tcp: the request's bytes at the best tcp stream of this run (1 MiB).
                floor_ms = None
                if t == "shm":
                    floor_ms = g("memcpy dsv4-pro 8k", "pool", "request")
                    floor_name = "kvwire-memcpy-floor, the same ranges"
                else:
                    bw = [v for v in (best_tcp(1 << 20), g("iperf3", "-", 1 << 20)) if v]
                    if bw:
                        floor_ms = row["bytes"] / (max(bw) * 1e9) * 1e3
                    floor_name = f"{max(bw):.2f} GB/s" if bw else "no tcp stream measured"
                t_ms = row["lat_avg_us"] / 1e3
                ratio = t_ms / floor_ms if floor_ms else None
                # Faster than its floor is not a goal met but a measurement to doubt.
                if ratio is None:
                    verdict = "MISSED (no floor measured)"
                elif ratio < 1:
                    verdict = "MISSED (below its floor: suspect measurement)"
                else:
                    verdict = "met" if ratio <= 1.25 else "MISSED"
                kv_lines.append(
                    f"dsv4-pro 8k request {op:<5} {t}: {row['bytes'] / 1e6:.1f} MB in "
                    f"{t_ms:6.2f} ms (p99 {row['lat_p99_us'] / 1e3:6.2f}); floor "
                    f"{'-' if floor_ms is None else f'{floor_ms:6.2f}'} ms ({floor_name}) -> "
                    f"{'-' if ratio is None else f'{ratio:.2f}'}x, goal <= 1.25x {verdict}; "
                    f"ops {row['ops_before_merge']} -> {row['ops_after_merge']} merged -> "
                    f"{row['ops_posted']} posted")
    else:
        kv_lines.append("dsv4-pro 8k request: not measured (the kv workload needs the "
                        "connector's layouts, issue 4)")
    lines.append("")
    lines.extend(kv_lines)
    lines.append("")
    lines.append(f"kvwire-perf: -l {args.batch} -t {args.depth}, tcp -q {args.qps}; 1 thread per "
                 f"side for every tool; pool = {POOL_MIB} MiB per side, blocks in random order; "
                 f"{args.runs} rounds, {seconds / 60:.1f} min")
    return {"table": "\n".join(lines), "goals": goals}


def plot(args, med):
    """Two panels (same-host memory paths, tcp paths): bandwidth vs size, every series."""
    if shutil.which("gnuplot") is None:
        print("gnuplot not found: no plot", file=sys.stderr)
        return
    panels = {"shm": {}, "tcp": {}}
    for (name, pattern, size), v in med.items():
        if size == "request" or isinstance(v, dict):
            continue
        panel = "tcp" if ("tcp" in name or name == "iperf3") else "shm"
        label = f"{name} ({pattern})" if pattern != "-" else name
        panels[panel].setdefault(label, []).append((size, v))
    folder = tempfile.mkdtemp()
    plots = []
    for panel, title in (("shm", "same host: memcpy, ucx posix/cma, nixl shm, kvwire shm"),
                         ("tcp", "tcp loopback: iperf3, ucx, nixl, mooncake, kvwire tcp")):
        data = os.path.join(folder, f"{panel}.dat")
        clauses = []
        with open(data, "w") as f:
            for i, (label, pts) in enumerate(sorted(panels[panel].items())):
                f.write(f"# {label}\n")
                for size, v in sorted(pts):
                    f.write(f"{size / 1024} {v}\n")
                f.write("\n\n")
                # kvwire solid and thick, peers dashed, floors dotted.
                dt = 1 if label.startswith("kvwire") else (3 if label.startswith(
                    ("memcpy", "iperf3")) else 2)
                lw = 2.5 if label.startswith("kvwire") else 1.5
                clauses.append(f'"{data}" index {i} using 1:2 with linespoints dt {dt} lw {lw} '
                               f'lc {i + 1} pt {i % 13 + 1} title "{label}"')
        if not clauses:  # nothing of this panel ran (--only, or every tool failed)
            continue
        plots.append(f'set title "{title}"\nplot ' + ", \\\n  ".join(clauses))
    if not plots:
        print("no bandwidth measured: no plot", file=sys.stderr)
        return
    script = f"""
set terminal pngcairo noenhanced size 1600,700 font ",10"
set output "{os.path.abspath(args.plot)}"
set multiplot layout 1,2 title "kvwire-perf vs floors and peers, median of {args.runs} rounds, decimal GB/s"
set logscale x 2
set xrange [48:5600]
set xtics ("64 KiB" 64, "1 MiB" 1024, "4 MiB" 4096)
set xlabel "message size"
set ylabel "GB/s (1e9 B/s)"
set key top right font ",8"
set grid
set yrange [0:*]
{chr(10).join(plots)}
unset multiplot
"""
    r = subprocess.run(["gnuplot"], input=script, text=True, capture_output=True)
    if r.returncode != 0:
        print("gnuplot failed: " + r.stderr, file=sys.stderr)


def machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 1048576:.0f} GiB RAM"
    except OSError:
        pass
    ucx = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True).stdout.split("\n")
    ucx = next((l.strip("# ") for l in ucx if "version" in l.lower()), "?")
    return (f"{cpu}, {os.cpu_count()} cores, {mem}, Linux {platform.release()}, "
            f"UCX {ucx.replace('Version ', '')}")


KEPT_MARKER = "<!-- kept by make compare: what follows is not regenerated -->"


def write_results(args, report):
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""# kvwire-perf side by side

Generated by `make compare` (perf/compare/compare.py) on {now}. Do not edit by hand: run
`make compare` again.

Machine: {machine()}. {report['load']}

Peers: {report['peers']}.

Every number is the median of {args.runs} rounds in decimal GB/s (1e9 B/s); in each round
every tool runs once, in turn. ucx_perftest's "MB/s" (MiB/s) is converted. "hot" reuses one
buffer on each side (what ucx_perftest does); "pool" moves blocks in random order over a
{POOL_MIB} MiB pool on each side (what a KV cache is; ucx_perftest cannot do it). UCX
emulates put/get over tcp with active messages; its tag_bw is its real tcp figure. iperf3
runs 2 s with -l set to the size (at most 1 MiB, its limit).

```
{report['table']}
```

![bandwidth vs size]({os.path.basename(args.plot)})
"""
    # Sections measured by other means (e.g. "End-to-end checksums") follow KEPT_MARKER and
    # survive a regeneration.
    try:
        with open(args.results) as f:
            old = f.read()
        if KEPT_MARKER in old:
            text += "\n" + old[old.index(KEPT_MARKER):]
    except OSError:
        pass
    with open(args.results, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
