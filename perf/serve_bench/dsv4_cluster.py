"""kvwire-dsv4 server processes on loopback for the serving benchmark and its test.

Every server binds port 0 and reports its ports through --ready-file; children die with
their parent (PR_SET_PDEATHSIG) and are stopped (SIGTERM, then SIGKILL after a grace
period) when the Cluster closes, so nothing is left running.
"""

import ctypes
import json
import os
import signal
import subprocess
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent():
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class ClusterError(RuntimeError):
    pass


class Cluster:
    """Processes of one configuration; a context manager that stops them all."""

    def __init__(self, binary: str, work_dir: str):
        self.binary = binary
        self.work_dir = work_dir
        os.makedirs(work_dir, exist_ok=True)
        self.procs: list[tuple[str, subprocess.Popen, str]] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def log_tail(self, name: str, size: int = 3000) -> str:
        path = os.path.join(self.work_dir, f"{name}.log")
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - size))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def start(self, name: str, args: list[str], timeout_s: float = 120.0) -> dict:
        """Starts `kvwire-dsv4 args... --ready-file F`; returns the ready file's JSON."""
        ready = os.path.join(self.work_dir, f"{name}.ready.json")
        if os.path.exists(ready):
            os.remove(ready)
        log = open(os.path.join(self.work_dir, f"{name}.log"), "wb")
        try:
            p = subprocess.Popen([self.binary, *args, "--ready-file", ready], stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=_die_with_parent)
        finally:
            log.close()
        self.procs.append((name, p, ready))
        deadline = time.monotonic() + timeout_s
        while True:
            if os.path.exists(ready):
                try:
                    with open(ready) as f:
                        return json.load(f)
                except (OSError, ValueError):
                    pass  # written atomically (rename): a partial read is not expected
            if p.poll() is not None:
                raise ClusterError(f"{name} exited ({p.returncode}) before it was ready:\n"
                                   f"{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{name}: no ready file within {timeout_s:g} s:\n"
                                   f"{self.log_tail(name)}")
            time.sleep(0.05)

    def check_alive(self):
        for name, p, _ in self.procs:
            if p.poll() is not None:
                raise ClusterError(f"{name} exited ({p.returncode}):\n{self.log_tail(name)}")

    def stop(self, grace_s: float = 20.0) -> dict[str, int]:
        """SIGTERM to every process (router first), SIGKILL after grace_s; exit codes."""
        codes = {}
        for name, p, _ in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, p, _ in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            codes[name] = p.returncode
        self.procs.clear()
        return codes


def ensure_weights(binary: str, config: str, out: str, timeout_s: float = 600.0) -> str:
    """Writes the config's weights once (the file is reused when it exists)."""
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        tmp = out + ".tmp"
        subprocess.run([binary, "weights", "--config", config, "--out", tmp], check=True,
                       stdout=subprocess.DEVNULL, timeout=timeout_s)
        os.replace(tmp, out)
    return out


def serve_args(role: str, config: str, weights: str, *, mode: str = "auto",
               transport: str = "auto", threads: int = 1, num_blocks: int = 0,
               max_requests: int = 0, name: str = "", extra: list[str] | None = None) -> list[str]:
    """Server flags; num_blocks and max_requests 0: the server's defaults."""
    a = ["serve", "--role", role, "--config", config, "--weights", weights, "--mode", mode,
         "--transport", transport, "--threads", str(threads)]
    if max_requests:
        a += ["--max-requests", str(max_requests)]
    if num_blocks:
        a += ["--num-blocks", str(num_blocks)]
    if name:
        a += ["--name", name]
    return a + (extra or [])


def start_aggregated(cluster: Cluster, config: str, weights: str, *, instances: int = 1,
                     threads: int = 1, num_blocks: int = 0, max_requests: int = 0,
                     extra: list[str] | None = None) -> tuple[list[str], list[str]]:
    """`instances` whole ("both") servers; returns (base URLs, instance URLs)."""
    urls = []
    for i in range(instances):
        r = cluster.start(f"agg{i}", serve_args("both", config, weights, threads=threads,
                                                num_blocks=num_blocks,
                                                max_requests=max_requests, extra=extra))
        urls.append(f"http://{r['address']}")
    return urls, urls


def start_disaggregated(cluster: Cluster, config: str, weights: str, *, mode: str,
                        transport: str, prefill: int = 1, decode: int = 1, threads: int = 1,
                        num_blocks: int = 0, max_requests: int = 0,
                        extra: list[str] | None = None) -> tuple[list[str], list[str]]:
    """xPyD behind a router; returns ([router URL], instance URLs)."""
    addrs: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, n in (("prefill", prefill), ("decode", decode)):
        for i in range(n):
            r = cluster.start(f"{role}{i}", serve_args(
                role, config, weights, mode=mode, transport=transport, threads=threads,
                num_blocks=num_blocks, max_requests=max_requests, extra=extra))
            addrs[role].append(r["address"])
    r = cluster.start("router", ["router", "--prefill", ",".join(addrs["prefill"]), "--decode",
                                 ",".join(addrs["decode"]), "--mode", mode])
    return [f"http://{r['address']}"], [f"http://{a}" for a in addrs["prefill"] + addrs["decode"]]
