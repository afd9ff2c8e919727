"""kv_connector_extra_config of kvwire's vLLM connector: the keys, their meaning, and Settings
(the checked values)."""
import dataclasses
import os
import stat
from typing import Any

# kv_connector_extra_config keys, with what they mean (errors list them).
EXTRA_CONFIG_KEYS = {
    "mode": "read | write | auto: the hand-offs this engine accepts (default auto)",
    "read_mode": "MoRIIO's flag: true = read mode, false = write mode",
    "transport": "auto | tcp | shm | rdma (default auto)",
    "listen_address": "host:port of the worker's control channel (default <host_ip>:0)",
    "host_ip": "host advertised in kv_transfer_params (default: the listen host)",
    "secret": "the deployment's shared secret (prefer secret_file)",
    "secret_file": "file holding the shared secret (mode 600)",
    "metrics_address": "host:port of GET /metrics and /stats.json per worker (port 0 free)",
    "request_timeout_s": "a transfer's deadline, and the lease on blocks held for a reader",
    "read_grants": "true (default): a peer READs only the blocks handed to it (each op "
                   "checked: copied by the owner over shm, over tcp instead of rdma); "
                   "false: zero-copy shm/rdma READs of the whole KV by any peer with the secret",
    "verify_checksums": "true: every KV op is checked end to end with CRC32C, a corrupted "
                        "transfer fails instead of landing (docs/CHECKSUMS.md); default false",
    "groups": "per vLLM KV cache group: {name, tokens_per_entry, window_tokens, "
              "per_request_state, section_row_bytes} overriding what the cache spec says "
              "(section_row_bytes: where a page keeps each entry, e.g. [576, 8] for "
              "DeepSeek-V4's KV pages; read grants need it for caches kvwire cannot read it "
              "from)",
}


def _read_secret_file(path: str) -> bytes:
    """A shared secret from a file, as kvwire-dsv4 and kvwire-perf read --secret-file: the
    bytes less one trailing newline; refused when others can read it or anyone but the owner
    can write it, or when it is empty or over 4 KiB."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"secret file {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH):
            raise ValueError(f"secret file {path} can be read or written by other users "
                             f"(mode {mode:04o}): chmod 600 {path}")
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    if len(data) > 4096:
        raise ValueError(f"secret file {path} is larger than 4096 bytes")
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise ValueError(f"secret file {path} is empty")
    return data


def _flag(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"kv_connector_extra_config: '{name}' must be true or false, got {value!r}")


@dataclasses.dataclass
class Settings:
    """kv_connector_extra_config, checked."""
    mode: str = "auto"
    transport: str = "auto"
    listen_address: str = ""
    host_ip: str = ""
    secret: Any = None
    metrics_address: str = ""
    request_timeout_s: float = 60.0
    read_grants: bool = True
    verify_checksums: bool = False
    groups: list = dataclasses.field(default_factory=list)

    @staticmethod
    def from_extra(extra) -> "Settings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in EXTRA_CONFIG_KEYS.items())
            raise ValueError(f"kvwire connector: unknown kv_connector_extra_config key(s) "
                             f"{unknown}; known keys are {known}")
        s = Settings()
        mode = extra.get("mode")
        if mode is not None and mode not in ("read", "write", "auto"):
            raise ValueError(f"kv_connector_extra_config: 'mode' must be read, write or auto, "
                             f"got {mode!r}")
        if extra.get("read_mode") is not None:
            flag_mode = "read" if _flag(extra["read_mode"], "read_mode") else "write"
            if mode not in (None, "auto", flag_mode):
                raise ValueError(f"kv_connector_extra_config: 'read_mode' "
                                 f"({extra['read_mode']!r}) says {flag_mode} mode but 'mode' "
                                 f"says {mode}")
            mode = flag_mode
        s.mode = mode or "auto"
        s.transport = str(extra.get("transport", "auto"))
        if s.transport not in ("auto", "tcp", "shm", "rdma"):
            raise ValueError(f"kv_connector_extra_config: 'transport' must be auto, tcp, shm or "
                             f"rdma, got {s.transport!r}")
        s.host_ip = str(extra.get("host_ip") or "")
        s.listen_address = str(extra.get("listen_address") or
                               (f"{s.host_ip}:0" if s.host_ip else "127.0.0.1:0"))
        if extra.get("secret_file"):
            s.secret = _read_secret_file(extra["secret_file"])
        elif extra.get("secret") is not None:
            s.secret = extra["secret"]
        s.metrics_address = str(extra.get("metrics_address") or "")
        try:
            s.request_timeout_s = float(extra.get("request_timeout_s", 60.0))
        except (TypeError, ValueError):
            raise ValueError("kv_connector_extra_config: 'request_timeout_s' must be a number, "
                             f"got {extra.get('request_timeout_s')!r}") from None
        if not 0 < s.request_timeout_s <= 86400:
            raise ValueError("kv_connector_extra_config: 'request_timeout_s' must be in "
                             f"(0, 86400], got {s.request_timeout_s}")
        if extra.get("read_grants") is not None:
            s.read_grants = _flag(extra["read_grants"], "read_grants")
        if extra.get("verify_checksums") is not None:
            s.verify_checksums = _flag(extra["verify_checksums"], "verify_checksums")
        groups = extra.get("groups") or []
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError("kv_connector_extra_config: 'groups' must be a list of objects, "
                             "one per vLLM KV cache group")
        allowed = {"name", "tokens_per_entry", "window_tokens", "per_request_state",
                   "section_row_bytes"}
        for i, g in enumerate(groups):
            bad = sorted(set(g) - allowed)
            if bad:
                raise ValueError(f"kv_connector_extra_config: groups[{i}] has unknown key(s) "
                                 f"{bad} (known: {sorted(allowed)})")
            rows = g.get("section_row_bytes")
            if rows is not None and (not isinstance(rows, list) or not rows or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in rows)):
                raise ValueError(f"kv_connector_extra_config: groups[{i}].section_row_bytes "
                                 "must be a list of positive integers (the row bytes of each "
                                 "section of a page)")
        s.groups = groups
        return s
