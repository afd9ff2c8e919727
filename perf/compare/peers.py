"""The peer libraries in `make compare` (issue 23): NIXL (UCX backend) and Mooncake's Transfer
Engine through their Python APIs, a current UCX's ucx_perftest (the libucx-cu12 wheel's), and
kvwire's one-at-a-time latency, measured in the same rounds as compare.py's other tools.

compare.py (system python) calls measurements() for the thunks of one round and render() for
the tables and goals; the drivers (nixl_peer.py, mooncake_peer.py) run in the virtual
environment `make compare` installs (scripts/compare-venv.sh), each as its own pair of
processes. A peer that does not install, import or run is a row that says why.
"""
import glob
import json
import os
import re
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
LAT_SIZES = [4 << 10, 64 << 10]
OPS = ("WRITE", "READ")
PATTERNS = ("hot", "pool")
# Drivers and the transports each is measured over ("shm": same host, the peer's own choice of
# shared memory; "tcp": loopback sockets).
DRIVERS = {
    "nixl": ("nixl_peer.py", ("tcp", "shm")),
    "mooncake": ("mooncake_peer.py", ("tcp",)),
}
TCP_LIBS = ["nixl tcp", "mooncake tcp"]
SHM_LIBS = ["nixl shm"]
UCX_NEW = "ucx-1.22"  # the libucx-cu12 wheel's ucx_perftest (version read at run time)


def _size(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


class Peers:
    def __init__(self, args, runner):
        self.args = args
        self.runner = runner
        self.python = os.path.join(args.venv, "bin", "python")
        self.errors = {}  # peer -> why it does not run (setup), printed as its row
        self.ranges = os.path.join(runner.tmp, "dsv4-pro-8k.ranges")
        self.quick = args.quick
        self.ucx_bin, self.ucx_lib = self._find_ucx()
        self._probe()

    # --- setup --------------------------------------------------------------------------
    def _find_ucx(self):
        found = glob.glob(os.path.join(self.args.venv, "lib", "python3*", "site-packages",
                                       "libucx", "bin", "ucx_perftest"))
        if not found:
            self.errors[UCX_NEW] = (f"no ucx_perftest in {self.args.venv} (libucx-cu12 not "
                                    "installed: run `make compare`, which installs it)")
            return None, None
        return found[0], os.path.join(os.path.dirname(os.path.dirname(found[0])), "lib")

    def _probe(self):
        failed = os.path.join(self.args.venv, "install-errors")  # scripts/compare-venv.sh's
        for peer, key in (("nixl", "nixl"), ("mooncake", "mooncake"), ("ucx", UCX_NEW)):
            path = os.path.join(failed, peer)
            if os.path.exists(path):
                with open(path) as f:
                    self.errors[key] = "pip install failed: " + f.read().strip()[-400:]
        if not os.path.exists(self.python):
            for peer in DRIVERS:
                self.errors[peer] = (f"no virtual environment at {self.args.venv} "
                                     "(`make compare` makes it: scripts/compare-venv.sh)")
            return
        for peer, module in (("nixl", "nixl_cu12"), ("mooncake", "mooncake.engine")):
            if peer in self.errors:
                continue
            r = subprocess.run([self.python, "-c", f"import {module}"], capture_output=True,
                               text=True, timeout=120)
            if r.returncode != 0:
                self.errors[peer] = f"import {module}: " + r.stderr.strip().splitlines()[-1]

    def dump_ranges(self):
        r = subprocess.run([self.runner.perf, "--workload", "kv", "--layout", "dsv4-pro",
                            "--prompt", "8192", "--frag", "0.5", "--requests", "1",
                            "--dump-ranges", self.ranges], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            raise RuntimeError("kvwire-perf --dump-ranges: " + (r.stderr or r.stdout)[-400:])

    # --- one measurement ----------------------------------------------------------------
    def driver(self, peer, transport, mode, op, size=0, pattern="hot"):
        if peer in self.errors:
            raise RuntimeError(self.errors[peer])
        script, _ = DRIVERS[peer]
        argv = [self.python, os.path.join(HERE, script), "run", "--transport", transport,
                "--mode", mode, "--op", op, "--pool-mib", str(self.runner.pool_mib)]
        if mode == "bw":
            budget = (1 << 30) if transport == "tcp" else (4 << 30)
            if self.quick:
                budget //= 8
            argv += ["--size", str(size), "--pattern", pattern, "--budget", str(budget)]
        elif mode == "lat":
            argv += ["--size", str(size), "--iters", "300" if self.quick else "3000"]
        else:
            if not os.path.exists(self.ranges):
                self.dump_ranges()
            argv += ["--ranges", self.ranges, "--iters", "5" if self.quick else "20"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
        if not lines:
            raise RuntimeError(f"{peer} {transport} {mode}: exit {r.returncode}, no result: "
                               f"{(r.stderr or r.stdout).strip()[-500:]}")
        result = json.loads(lines[-1])
        if "error" in result:
            raise RuntimeError(result["error"])
        return result

    def ucx_lat(self, tls, size):
        """ucx_perftest 1.22 ucp_get -O 1, one get outstanding: its typical latency."""
        if UCX_NEW in self.errors:
            raise RuntimeError(self.errors[UCX_NEW])
        return self.runner.ucx("ucp_get", tls, size, tool=self.ucx_tool(), latency=True)

    def ucx_tool(self):
        if UCX_NEW in self.errors:
            raise RuntimeError(self.errors[UCX_NEW])
        return (self.ucx_bin, self.ucx_lib)

    def versions(self):
        """The installed peers' versions (or why they are missing), for RESULTS.md."""
        got = "?"
        if os.path.exists(self.python):
            r = subprocess.run([self.python, "-c", (
                "import importlib.metadata as m\n"
                "for p in ('nixl-cu12', 'mooncake-transfer-engine-non-cuda', 'libucx-cu12'):\n"
                "    try: print(p, m.version(p))\n"
                "    except m.PackageNotFoundError: print(p, 'not installed')")],
                capture_output=True, text=True, timeout=60)
            got = ", ".join(r.stdout.split("\n")[:3]).strip(", ")
        errors = "; ".join(f"{k}: {v}" for k, v in self.errors.items())
        return (f"{got} (PyPI, in {self.args.venv}); ucx_perftest of UCX {self.ucx_version()}"
                + (f"; not runnable: {errors}" if errors else ""))

    def ucx_version(self):
        if self.ucx_bin is None:
            return "not installed"
        r = subprocess.run([os.path.join(os.path.dirname(self.ucx_bin), "ucx_info"), "-v"],
                           capture_output=True, text=True,
                           env=dict(os.environ, LD_LIBRARY_PATH=self.ucx_lib))
        m = re.search(r"Library version: (\S+)", r.stdout)
        return m.group(1) if m else "?"


def _kvwire_lat(row):
    return {"p50_us": row["lat_p50_us"], "p99_us": row["lat_p99_us"],
            "avg_us": row["lat_avg_us"]}


def measurements(peers, sizes, have_kv):
    """(key, thunk) for every peer measurement of one round; key = (name, pattern, size)."""
    m = []
    for size in sizes:
        for peer, (_, transports) in DRIVERS.items():
            for t in transports:
                for op in OPS:
                    for pattern in PATTERNS:
                        m.append(((f"{peer} {t} {op}", pattern, size),
                                  lambda r, p=peer, t=t, o=op, s=size, pt=pattern:
                                  peers.driver(p, t, "bw", o, s, pt)["gbs"]))
        for test, name in (("tag_bw", "tcp tag_bw"), ("ucp_put_bw", "tcp put"),
                           ("ucp_get", "tcp get")):
            m.append(((f"{UCX_NEW} {name}", "hot", size),
                      lambda r, s=size, t=test: r.ucx(t, "tcp", s, tool=peers.ucx_tool())))
        for test, name in (("ucp_put_bw", "posix put"), ("ucp_get", "posix get")):
            m.append(((f"{UCX_NEW} {name}", "hot", size),
                      lambda r, s=size, t=test: r.ucx(t, "posix,self", s, tool=peers.ucx_tool())))
    for size in LAT_SIZES:
        for transport in ("tcp", "shm"):
            for op in OPS:
                m.append(((f"lat kvwire {transport} {op}", "hot", size),
                          lambda r, t=transport, o=op, s=size: _kvwire_lat(
                              r.kvwire(t, o.lower(), s, latency=True))))
        for peer, (_, transports) in DRIVERS.items():
            for t in transports:
                for op in OPS:
                    m.append(((f"lat {peer} {t} {op}", "hot", size),
                              lambda r, p=peer, t=t, o=op, s=size: peers.driver(p, t, "lat", o, s)))
        for tls, name in (("tcp", "tcp"), ("posix,self", "shm")):
            m.append(((f"lat {UCX_NEW} {name} READ", "hot", size),
                      lambda r, tl=tls, s=size: peers.ucx_lat(tl, s)))
    if have_kv:
        for peer, (_, transports) in DRIVERS.items():
            for t in transports:
                for op in OPS:
                    m.append(((f"{peer} {t} dsv4-pro 8k {op}", "pool", "request"),
                              lambda r, p=peer, t=t, o=op: peers.driver(p, t, "kv", o)))
    return m


# "The best peer" is known only when every peer of the comparison was measured: a peer that
# did not run (not installed, failed, left out by --only) leaves the ratio unknown, so its goal
# row prints "-" and MISSED rather than "met" against a partial field.
def _best(values):
    return None if not values or any(v is None for v in values) else max(values)


def _least(values):
    return None if not values or any(v is None for v in values) else min(values)


def render(peers, med, sizes, have_kv, failures):
    """Lines of the peers' tables and their goals: (lines, goals); a goal is (label, pattern,
    ratios, goal text, met). `failures` maps a key to its last error (rows with no value)."""
    lines, goals = [], []

    def g(name, pattern, size):
        return med.get((name, pattern, size))

    def why(name, pattern, size):
        err = failures.get((name, pattern, size))
        return f"   not run: {err[:150]}" if err else ""

    # Bandwidth of the libraries, every op and pattern.
    head = f"{'peer bandwidth (decimal GB/s, median)':<34} {'pattern':<7}" + "".join(
        f" {_size(s):>8}" for s in sizes)
    lines += [head, "-" * len(head)]
    names = [f"{p} {t} {op}" for p, (_, ts) in DRIVERS.items() for t in ts for op in OPS]
    names += [f"{UCX_NEW} {n}" for n in ("tcp tag_bw", "tcp put", "tcp get", "posix put",
                                         "posix get")]
    for name in names:
        for pattern in PATTERNS:
            vals = [g(name, pattern, s) for s in sizes]
            if name.startswith(UCX_NEW) and pattern == "pool":
                continue  # ucx_perftest reuses one buffer: it has no pool pattern
            cells = "".join(f" {('   -  ' if v is None else f'{v:6.2f}'):>8}" for v in vals)
            note = "" if any(v is not None for v in vals) else why(name, pattern, sizes[0])
            lines.append(f"{name:<34} {pattern:<7}{cells}{note}")
    lines.append("")

    def ratio_row(label, pattern, num, den, goal, higher_better=True):
        vals = []
        for s in sizes:
            a, b = num(s), den(s)
            vals.append(None if a is None or b in (None, 0) else a / b)
        if higher_better:
            met = all(v is not None and v >= goal for v in vals)
            text = f">= {goal:.2f}"
        else:
            met = all(v is not None and v <= goal for v in vals)
            text = f"<= {goal:.2f}"
        lines.append(f"{label:<42} {pattern:<5}" + "".join(
            f" {('   -  ' if v is None else f'{v:6.2f}x'):>8}" for v in vals)
            + f"  {text} {'met' if met else 'MISSED'}")
        goals.append((label, pattern, vals, text, met))

    lines.append(f"{'ratio vs the libraries':<42} {'pat':<5}" + "".join(
        f" {_size(s):>8}" for s in sizes) + "   goal")
    lines.append("-" * (len(head) + 16))
    for op in OPS:
        for pattern in PATTERNS:
            ucx_tcp = (["tcp tag_bw", "tcp put"] if op == "WRITE" else ["tcp get"])
            ucx_tcp = [f"{UCX_NEW} {n}" for n in ucx_tcp] if pattern == "hot" else []
            ratio_row(f"kvwire tcp {op} / best tcp peer", pattern,
                      lambda s, o=op, p=pattern: g(f"kvwire tcp {o}", p, s),
                      lambda s, o=op, p=pattern, u=ucx_tcp: _best(
                          [g(f"{n} {o}", p, s) for n in TCP_LIBS] + [g(n, "hot", s) for n in u]),
                      1.1)
    for op in OPS:
        for pattern in PATTERNS:
            ucx_shm = [f"{UCX_NEW} posix {'put' if op == 'WRITE' else 'get'}",
                       f"ucx posix {'put' if op == 'WRITE' else 'get'}"]
            ucx_shm = ucx_shm if pattern == "hot" else []
            ratio_row(f"kvwire shm {op} / best same-host peer", pattern,
                      lambda s, o=op, p=pattern: g(f"kvwire shm {o}", p, s),
                      lambda s, o=op, p=pattern, u=ucx_shm: _best(
                          [g(f"{n} {o}", p, s) for n in SHM_LIBS] + [g(n, "hot", s) for n in u]),
                      1.0)
    lines.append("")

    # Latency: one transfer in flight, submission to completion.
    lat_head = f"{'latency, one at a time (us)':<34} {'':<7}" + "".join(
        f" {_size(s) + ' p50':>11} {'p99':>8}" for s in LAT_SIZES)
    lines += [lat_head, "-" * len(lat_head)]
    lat_names = [f"kvwire {t} {op}" for t in ("tcp", "shm") for op in OPS]
    lat_names += [f"{p} {t} {op}" for p, (_, ts) in DRIVERS.items() for t in ts for op in OPS]
    lat_names += [f"{UCX_NEW} tcp READ", f"{UCX_NEW} shm READ"]

    def lat(name, size, field):
        row = g(f"lat {name}", "hot", size)
        return None if row is None else row.get(field)

    for name in lat_names:
        cells = ""
        for s in LAT_SIZES:
            p50, p99 = lat(name, s, "p50_us"), lat(name, s, "p99_us")
            cells += f" {('-' if p50 is None else f'{p50:.1f}'):>11} " \
                     f"{('-' if p99 is None else f'{p99:.1f}'):>8}"
        note = ""
        if all(lat(name, s, "p50_us") is None for s in LAT_SIZES):
            note = why(f"lat {name}", "hot", LAT_SIZES[0])
        lines.append(f"{name:<34} {'':<7}{cells}{note}")
    lines.append(f"({UCX_NEW}: `ucp_get -O 1` (one get outstanding), its typical latency as "
                 "p50; ucx_perftest prints no p99)")
    lines.append("")

    def lat_ratio(transport, op):
        peers_of = ([f"{n} {op}" for n in TCP_LIBS] + ([f"{UCX_NEW} tcp READ"] if op == "READ"
                                                      else [])
                    if transport == "tcp" else
                    [f"{n} {op}" for n in SHM_LIBS] + ([f"{UCX_NEW} shm READ"] if op == "READ"
                                                       else []))
        vals = []
        for s in LAT_SIZES:
            ours = lat(f"kvwire {transport} {op}", s, "p50_us")
            best = _least([lat(n, s, "p50_us") for n in peers_of])
            vals.append(None if ours is None or not best else ours / best)
        met = all(v is not None and v <= 0.8 for v in vals)
        label = f"kvwire {transport} {op} p50 / best peer p50"
        lines.append(f"{label:<42} " + "".join(
            f" {_size(s):>7} {('-' if v is None else f'{v:.2f}x'):>6}" for s, v in zip(LAT_SIZES, vals))
            + f"  <= 0.80 {'met' if met else 'MISSED'}")
        goals.append((label, "hot", vals, "<= 0.80", met))

    for transport in ("tcp", "shm"):
        for op in OPS:
            lat_ratio(transport, op)
    lines.append("")

    # The dsv4-pro 8k request as one batch.
    if not have_kv:
        lines.append("dsv4-pro 8k request through the peers: not measured (no kv workload)")
        return lines, goals
    kv_rows = {}
    for t in ("tcp", "shm"):
        for op in OPS:
            kv_rows[(f"kvwire {t}", op)] = g(f"kvwire {t} dsv4-pro 8k {op}", "pool", "request")
            for p, (_, ts) in DRIVERS.items():
                if t in ts:
                    kv_rows[(f"{p} {t}", op)] = g(f"{p} {t} dsv4-pro 8k {op}", "pool", "request")
    pages = next((r.get("pages") for r in kv_rows.values() if r and r.get("pages")), None)
    lines.append(f"dsv4-pro 8k request as one batch ({pages or '?'} pages; each peer gets the "
                 "ranges kvwire's engine gets), one request at a time:")

    def request_ms(row):
        if row is None:
            return None
        return row["request_ms"] if "request_ms" in row else row["lat_avg_us"] / 1e3

    for (name, op), row in kv_rows.items():
        ms = request_ms(row)
        if ms is None:
            key = (f"{name} dsv4-pro 8k {op}", "pool", "request")
            lines.append(f"  {name:<16} {op:<5}      -{why(*key)}")
            continue
        n_pages = row.get("pages") or row.get("ops_before_merge") or pages or 1
        lines.append(f"  {name:<16} {op:<5} {ms:8.2f} ms per request  "
                     f"{ms * 1e3 / n_pages:7.2f} us per page")
    for t in ("tcp", "shm"):
        for op in OPS:
            ours = request_ms(kv_rows.get((f"kvwire {t}", op)))
            best = _least([request_ms(kv_rows.get((f"{p} {t}", op)))
                           for p, (_, ts) in DRIVERS.items() if t in ts])
            ratio = None if ours is None or not best else ours / best
            met = ratio is not None and ratio <= 0.8
            label = f"dsv4-pro 8k {op} {t}: kvwire / best peer"
            lines.append(f"{label:<42} {('-' if ratio is None else f'{ratio:.2f}x'):>7}"
                         f"  <= 0.80 {'met' if met else 'MISSED'}")
            goals.append((label, "pool", [ratio], "<= 0.80", met))
    return lines, goals
