"""kvwire as a vLLM KV connector (KVConnectorBase_V1 + SupportsHMA).

Load it into vLLM with
    --kv-transfer-config '{"kv_connector": "KvwireConnector",
                           "kv_connector_module_path": "kvwire.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"transport": "tcp", ...}}'
(see python/README or the project README for every extra-config key).

vLLM runs the scheduler-side connector in the engine-core process and one worker-side
connector per GPU worker, apart when TP > 1. The two sides here share nothing but what vLLM
carries between them:
  - the worker-side connector owns the native kvwire.Connector (engine, registered KV caches,
    transfers); get_handshake_metadata() hands its control address to the scheduler, which
    vLLM delivers through set_xfer_handshake_metadata();
  - the scheduler-side connector is plain Python (no engine, no memory): it decides per
    request and puts what the workers must do into KvwireConnectorMetadata, which vLLM sends
    to every worker each step. Workers report back through get_finished() and
    get_block_ids_with_load_errors(), which vLLM aggregates into update_connector_output().

Read mode (the default hand-off, as NIXL's): prefill's request finishes with
FINISHED_LENGTH_CAPPED (max_tokens=1); request_finished_all_groups keeps its blocks and returns
kv_transfer_params in vLLM's names (remote_engine_id, remote_host, remote_port,
remote_block_ids, remote_request_id, tp_size, do_remote_prefill) plus kvwire's transfer_id
(128 random bits, the capability a reader presents), mode and num_tokens; decode READs the
blocks and releases them. Write mode (MoRIIO's default; kvwire "mode": "write"): decode
allocates first and sends its block ids; prefill WRITEs each layer as save_kv_layer reports it
final.

Tensor parallelism may differ on the two sides. A prefill with more ranks than the decode
names its other ranks in tp_sources, and each decode rank reads its heads from every rank
that holds some. A decode with more ranks than the prefill reads with each of its ranks: each
one its slice of the heads (MHA) or the whole replicated latent page (MLA). Each prefill rank's
hand-off then has one reader per decode rank, each with its own read grant, and its blocks are
freed once all of them released.

When vLLM is not importable the module still imports (with stand-in bases), so that kvwire's
plain Python API keeps working without it.
"""
import dataclasses
import json
import logging
import os
import re
import secrets
import stat
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
        KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorMetadata,
        KVConnectorRole, SupportsHMA)
    HAVE_VLLM = True
except ImportError:  # kvwire without vLLM: the class is usable, vLLM cannot load it anyway
    import abc
    import enum

    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(abc.ABC):  # noqa: B024
        pass

    class KVConnectorHandshakeMetadata(abc.ABC):  # noqa: B024
        pass

    class SupportsHMA(abc.ABC):  # noqa: B024
        pass

    class KVConnectorBase_V1(abc.ABC):  # noqa: N801
        def __init__(self, vllm_config, role, kv_cache_config):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def has_connector_metadata(self):
            return self._connector_metadata is not None

try:  # vLLM whose scheduler takes failed loads per request (failed_recving)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:
    KVConnectorTransferResults = None

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:
    @dataclasses.dataclass
    class KVConnectorStats:
        data: dict = dataclasses.field(default_factory=dict)

import _kvwire

logger = logging.getLogger("kvwire.vllm")

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
    "read_grants": "true (default): a peer READs only the blocks handed to it, over tcp; "
                   "false: zero-copy shm/rdma READs of the whole KV by any peer with the secret",
    "groups": "per vLLM KV cache group: {name, tokens_per_entry, window_tokens, "
              "per_request_state, section_row_bytes} overriding what the cache spec says "
              "(section_row_bytes: where a page keeps each entry, e.g. [576, 8] for "
              "DeepSeek-V4's KV pages; read grants need it for caches kvwire cannot read it "
              "from)",
}

_LAYER_RE = re.compile(r"\d+")


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


class KvwireConnectorMetadata(KVConnectorMetadata):
    """What the scheduler-side connector asks of every worker in one step. Plain data, so it
    crosses processes as vLLM sends it (pickled with the scheduler output).

      loads:    decode, {request_id, params (kvwire JSON), blocks, num_tokens, num_computed}
      saves:    prefill write mode, {request_id, params, blocks, num_tokens}
      holds:    prefill read mode, {request_id, transfer_id, blocks, num_tokens}
      finishes: the scheduler finished a request the workers still move, {request_id,
                aborted, blocks, num_tokens, params}
      failed:   decode loads refused before they started, {request_id, reason, block_ids}
                (block_ids: only the blocks the load would have filled, never local prefix
                blocks other requests may share)
      releases: decode will not load a prefill's hand-off (its prompt is in the local prefix
                cache, or it ended before its load started): {request_id, params, reason};
                worker rank 0 tells the prefill ranks to free the blocks now
    """

    def __init__(self):
        self.loads: list = []
        self.saves: list = []
        self.holds: list = []
        self.finishes: list = []
        self.failed: list = []
        self.releases: list = []

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.holds or self.finishes or self.failed or
                    self.releases)

    def __repr__(self):
        return (f"KvwireConnectorMetadata(loads={len(self.loads)}, saves={len(self.saves)}, "
                f"holds={len(self.holds)}, finishes={len(self.finishes)}, "
                f"failed={len(self.failed)}, releases={len(self.releases)})")


class KvwireHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's control-channel address, for its scheduler (vLLM carries it)."""

    def __init__(self, engine_id: str, address: str, tp_rank: int, host: str = ""):
        self.engine_id = engine_id
        self.address = address
        self.tp_rank = tp_rank
        self.host = host

    def __repr__(self):
        return (f"KvwireHandshakeMetadata(engine_id={self.engine_id!r}, "
                f"address={self.address!r}, tp_rank={self.tp_rank})")


class KvwireConnectorStats(KVConnectorStats):
    """Transfer counters of one interval (vLLM aggregates them over workers)."""

    KEYS = ("requests_completed", "requests_failed", "bytes")

    def __init__(self, data=None):
        super().__init__(data=dict(data or {}))

    def reset(self):
        self.data = {}

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict:
        return {k: self.data.get(k, 0) for k in self.KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in self.KEYS)


_HAND_OFF_STATUSES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def _hands_off(request) -> bool:
    """The finish statuses vLLM's P/D connectors hand off on (NIXL's): the prefill ran to
    max_tokens (1), or its first token was a stop token (FINISHED_STOPPED; the prompt's KV is
    complete either way). Any other end (abort, error) frees the blocks at once."""
    status = getattr(request, "status", None)
    return getattr(status, "name", str(status)) in _HAND_OFF_STATUSES


def _own_blocks(lists, num_computed: int, block_size: int) -> list:
    """Per group, the blocks a load fills: those past the tokens already computed locally
    (the local prefix-cache hit, whole blocks, which other requests may share)."""
    skip = max(int(num_computed), 0) // max(int(block_size), 1)
    return [list(ids[skip:]) for ids in lists]


def _prompt_len(request) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(getattr(request, "prompt_token_ids", None) or [])
    return int(n)


def _block_lists(blocks) -> list:
    """KVCacheBlocks (or per-group lists, or one flat list) -> [[ids of group 0], ...]."""
    if hasattr(blocks, "get_block_ids"):
        blocks = blocks.get_block_ids()
    blocks = list(blocks)
    if blocks and not isinstance(blocks[0], (list, tuple)):
        return [[int(b) for b in blocks]]
    return [[int(b) for b in g] for g in blocks]


def _group_specs(kv_cache_config):
    return list(getattr(kv_cache_config, "kv_cache_groups", None) or [])


def _group_names(kv_cache_config, settings: Settings) -> list:
    """kvwire group name of each vLLM KV cache group: its index ("0", "1", ...; then
    kv_transfer_params carry vLLM's per-group lists), or the name set in extra config."""
    n = max(len(_group_specs(kv_cache_config)), 1)
    names = []
    for i in range(n):
        o = settings.groups[i] if i < len(settings.groups) else {}
        names.append(str(o.get("name", i)))
    if len(set(names)) != len(names):
        raise ValueError(f"kvwire connector: group names repeat: {names}")
    return names


def _layer_index(layer_name) -> int:
    """'model.layers.12.self_attn.attn' -> 12."""
    found = _LAYER_RE.findall(str(layer_name))
    if not found:
        raise ValueError(f"kvwire connector: no layer index in layer name {layer_name!r}")
    return int(found[0])


class KvwireConnector(KVConnectorBase_V1, SupportsHMA):
    """kvwire's connector for vLLM. One class; the role picks the half that works."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = vllm_config.kv_transfer_config
        self._settings = Settings.from_extra(getattr(kvt, "kv_connector_extra_config", None))
        self._engine_id = str(getattr(kvt, "engine_id", None) or secrets.token_hex(8))
        self._kv_cache_config = kv_cache_config
        self._block_size = int(vllm_config.cache_config.block_size)
        self._tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp > 1:
            # Each pipeline stage holds other layers under the same tensor-parallel rank; the
            # hand-off names one worker per TP rank, so a stage's KV could not be found.
            raise ValueError(f"kvwire connector: pipeline parallelism is not supported "
                             f"(pipeline_parallel_size={pp}); run prefill and decode with "
                             f"pipeline_parallel_size=1 (tensor parallelism is supported)")
        self._names = _group_names(kv_cache_config, self._settings)
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self)
            self._worker = None
        else:
            self._sched = None
            self._worker = _WorkerSide(self)
        logger.info("kvwire connector %s (%s) engine %s mode %s transport %s",
                    type(self).__name__, role.name, self._engine_id, self._settings.mode,
                    self._settings.transport)

    # ---- observability / helpers (either side) -------------------------------------------
    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def native(self):
        """The worker's kvwire.Connector (None on the scheduler side)."""
        return self._worker.native if self._worker else None

    @property
    def address(self) -> str:
        return self._worker.native.address if self._worker else ""

    def stats(self) -> dict:
        return json.loads(self._worker.native.stats_json()) if self._worker else {}

    def prometheus(self) -> str:
        return self._worker.native.stats_prometheus() if self._worker else ""

    # ---- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        """One KV cache group (vLLM without the hybrid allocator): a flat block list."""
        return self._sched.request_finished(request, [list(block_ids)], flat=True)

    def request_finished_all_groups(self, request, block_ids):
        return self._sched.request_finished(request, _block_lists(block_ids))

    def set_xfer_handshake_metadata(self, metadata) -> None:
        self._sched.set_workers(metadata)

    def take_events(self):
        return ()

    def get_finished_count(self):
        return None  # every worker reports every request (vLLM's default: the world size)

    def has_pending_push_work(self) -> bool:
        return bool(self._sched and self._sched.pending_push_work())

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return None  # NHD and HND both map (register_kv_caches reads the strides)

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KvwireConnectorStats(data=data) if data is not None else KvwireConnectorStats()

    def reset_cache(self):
        return None

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._worker.handshake_metadata() if self._worker else None

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self):
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids):
        """vLLM without get_transfer_results: failed loads go as block ids."""
        sending, recving, _ = self._worker.get_transfer_results(finished_req_ids,
                                                                per_request=False)
        return sending, recving

    if KVConnectorTransferResults is not None:
        def get_transfer_results(self, finished_req_ids):
            sending, recving, failed = self._worker.get_transfer_results(finished_req_ids,
                                                                         per_request=True)
            return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                              finished_recving=set(recving or ()),
                                              failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set:
        return self._worker.take_load_errors() if self._worker else set()

    def get_kv_connector_stats(self):
        return self._worker.interval_stats() if self._worker else None

    def shutdown(self):
        if self._worker:
            self._worker.shutdown()


# ---------------------------------------------------------------------------------------------
# Scheduler side: plain Python, no engine and no KV memory in this process.
# ---------------------------------------------------------------------------------------------
class _SchedulerSide:
    def __init__(self, conn: KvwireConnector):
        self.c = conn
        self.workers: dict = {}  # tp rank -> KvwireHandshakeMetadata
        self.meta = KvwireConnectorMetadata()
        self.load_started: set = set()  # decode requests whose load went to the workers
        self.loading: dict = {}  # decode request id -> (blocks, num_tokens, params)
        self.pending_saves: dict = {}  # prefill write mode, not sent yet: id -> (req, entry)
        self.saving: dict = {}  # prefill write mode, sent: id -> entry
        self.holding: set = set()  # prefill read mode, blocks held for a reader

    # handshake ---------------------------------------------------------------------------
    def set_workers(self, metadata) -> None:
        workers = {}
        for rank, m in dict(metadata or {}).items():
            if not isinstance(m, KvwireHandshakeMetadata):
                raise ValueError(f"kvwire connector: handshake metadata of rank {rank} is "
                                 f"{type(m).__name__}, not KvwireHandshakeMetadata")
            workers[int(rank)] = m
        self.workers = workers
        logger.info("kvwire connector %s: workers %s", self.c.engine_id,
                    {r: m.address for r, m in sorted(workers.items())})

    def pending_push_work(self) -> bool:
        return bool(self.pending_saves or self.saving)

    # params ------------------------------------------------------------------------------
    def _table(self, lists) -> dict:
        names = self.c._names
        if len(lists) != len(names):
            raise ValueError(f"{len(lists)} block lists for {len(names)} KV cache groups")
        return {n: list(ids) for n, ids in zip(names, lists)}

    def _remote_table(self, remote) -> dict:
        """remote_block_ids as a decode's kvwire block table: vLLM's per-group lists (or one
        flat list for one group) map onto this engine's groups by index; an object by name."""
        if isinstance(remote, dict):
            return {str(k): v for k, v in remote.items()}
        if not isinstance(remote, list):
            raise ValueError(f"remote_block_ids must be a list or an object, got "
                             f"{type(remote).__name__}")
        if remote and all(isinstance(x, list) for x in remote):
            return self._table(remote)
        if len(self.c._names) != 1:
            raise ValueError(f"remote_block_ids is one flat list but this engine has "
                             f"{len(self.c._names)} KV cache groups")
        return {self.c._names[0]: remote}

    def _load_params(self, params: dict, prompt_len: int) -> str:
        """A decode request's kv_transfer_params as the kvwire JSON its worker loads with;
        ValueError with the reason when they cannot be used."""
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
        out = {k: v for k, v in params.items() if v is not None}
        out.pop("block_ids", None)
        remote = params.get("remote_block_ids")
        if remote is None:
            remote = params.get("block_ids")
        if remote is not None:
            out["remote_block_ids"] = self._remote_table(remote)
        sources = []
        for i, s in enumerate(params.get("tp_sources") or []):
            if not isinstance(s, dict):
                raise ValueError(f"tp_sources[{i}] must be an object")
            s = {k: v for k, v in s.items() if v is not None}
            rb = s.pop("remote_block_ids", None)
            rb = s.pop("block_ids", rb)
            if rb is not None:
                s["remote_block_ids"] = self._remote_table(rb)
            sources.append(s)
        if sources:
            out["tp_sources"] = sources
        n = params.get("num_tokens")
        out["num_tokens"] = prompt_len if n is None else min(int(n), prompt_len)
        out["do_remote_prefill"] = True
        out["do_remote_decode"] = False
        text = json.dumps(out)
        _kvwire.parse_kv_transfer_params(text)  # the worker's typed parser: ValueError if bad
        return text

    # vLLM's calls ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Decode (do_remote_prefill): the prompt tokens beyond the local prefix come from the
        prefill, asynchronously. No side effects (vLLM may call it again)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        if request.request_id in self.load_started:
            return 0, False
        count = _prompt_len(request) - int(num_computed_tokens)
        if count > 1:
            return count, True
        # Everything but the last prompt token is in the local prefix cache (vLLM never counts
        # the last one as a hit): vLLM computes that token here even after a load (it replays
        # it to sample the next), so nothing is loaded and the prefill is told to free its
        # blocks (update_state_after_alloc).
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        try:
            self._update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as e:  # noqa: BLE001 - a connector error must not end vLLM's loop
            rid = getattr(request, "request_id", "?")
            logger.error("kvwire connector: update_state_after_alloc(%s): %s; no transfer",
                         rid, e)
            params = getattr(request, "kv_transfer_params", None)
            if (isinstance(params, dict) and params.get("do_remote_prefill") and
                    num_external_tokens > 0 and rid in self.load_started and
                    rid not in self.loading):
                # vLLM waits for this load: it must end, as a failed one.
                try:
                    computed = max(_prompt_len(request) - int(num_external_tokens), 0)
                    flat = sorted({b for g in _own_blocks(_block_lists(blocks), computed,
                                                          self.c._block_size) for b in g})
                except Exception:  # noqa: BLE001
                    flat = []
                self.meta.failed.append({"request_id": rid, "reason": str(e),
                                         "block_ids": flat})
                self.loading[rid] = None

    def _update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict):
            return
        rid = request.request_id
        if params.get("do_remote_prefill"):
            if rid in self.load_started:
                return  # the second call, after the load: nothing more to do
            self.load_started.add(rid)
            if num_external_tokens <= 0:
                # A full local prefix hit: nothing to load, and the prefill frees its blocks
                # now rather than at the end of its lease.
                self._release(request, params, "decode found the prompt in its prefix cache")
                return
            lists = _block_lists(blocks)
            prompt_len = _prompt_len(request)
            num_computed = max(prompt_len - int(num_external_tokens), 0)
            # Only the blocks this load fills: a local prefix block may be shared.
            flat = sorted({b for g in _own_blocks(lists, num_computed, self.c._block_size)
                           for b in g})
            try:
                text = self._load_params(params, prompt_len)
                table = self._table(lists)
            except (ValueError, TypeError, RuntimeError) as e:
                # Never into vLLM: the load fails (its blocks reported as failed), and vLLM's
                # kv_load_failure_policy recomputes or fails the request; blocks are freed.
                reason = f"bad kv_transfer_params: {e}"
                logger.error("kvwire connector: request %s: %s", rid, reason)
                self.meta.failed.append({"request_id": rid, "reason": reason,
                                         "block_ids": flat})
                self.loading[rid] = None
                return
            self.meta.loads.append({"request_id": rid, "params": text, "blocks": table,
                                    "num_tokens": prompt_len, "num_computed": num_computed})
            self.loading[rid] = (table, prompt_len, text)
            return
        if params.get("do_remote_decode") and str(params.get("mode") or "") == "write":
            if rid in self.pending_saves or rid in self.saving:
                return
            lists = _block_lists(blocks)
            if self.c._settings.mode == "read":
                logger.error("kvwire connector: request %s asks for write mode but this engine "
                             "is 'read'; no hand-off", rid)
                return
            tid = params.get("transfer_id") or params.get("remote_request_id")
            if not isinstance(tid, str) or not tid:
                logger.error("kvwire connector: request %s: write mode without a transfer_id; "
                             "no hand-off", rid)
                return
            entry = {"request_id": rid, "blocks": self._table(lists),
                     "num_tokens": _prompt_len(request),
                     "params": json.dumps({"do_remote_decode": True, "mode": "write",
                                           "transfer_id": tid})}
            self.pending_saves[rid] = (request, entry)

    def _release(self, request, params, reason: str) -> None:
        """Decode will not load this hand-off: the workers tell the prefill ranks."""
        try:
            text = self._load_params(params, _prompt_len(request))
        except (ValueError, TypeError, RuntimeError) as e:
            logger.warning("kvwire connector: request %s: cannot tell the prefill to free its "
                           "blocks (bad kv_transfer_params: %s); its lease will", request.request_id,
                           e)
            return
        self.meta.releases.append({"request_id": request.request_id, "params": text,
                                   "reason": reason})

    def build_connector_meta(self, scheduler_output) -> KvwireConnectorMetadata:
        # Write mode: a save goes to the workers with the step that computes the last prompt
        # chunk (its layers are final at that step's save_kv_layer), with every block the
        # request got since (chunked prefill allocates as it goes).
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        new_blocks = {}
        if cached is not None:
            for rid, nb in zip(getattr(cached, "req_ids", []) or [],
                               getattr(cached, "new_block_ids", []) or []):
                if nb is not None:
                    new_blocks[rid] = _block_lists(nb)
        for rid in list(self.pending_saves):
            request, entry = self.pending_saves[rid]
            if rid in new_blocks:
                for name, ids in zip(self.c._names, new_blocks[rid]):
                    entry["blocks"][name].extend(ids)
            n = scheduled.get(rid)
            if n is None:
                continue  # not scheduled this step
            if int(getattr(request, "num_computed_tokens", 0)) + int(n) < entry["num_tokens"]:
                continue  # a partial prefill: not final yet
            del self.pending_saves[rid]
            self.meta.saves.append(entry)
            self.saving[rid] = entry
        meta, self.meta = self.meta, KvwireConnectorMetadata()
        return meta

    def request_finished(self, request, lists, flat=False):
        """(delay freeing the blocks, kv_transfer_params for the output). Never raises.
        `flat`: vLLM passed one flat list (no hybrid allocator); the params carry one too."""
        try:
            return self._request_finished(request, lists, flat)
        except Exception as e:  # noqa: BLE001 - a connector error must not end vLLM's loop
            logger.error("kvwire connector: request_finished(%s): %s; blocks freed now",
                         getattr(request, "request_id", "?"), e)
            return False, None

    def _request_finished(self, request, lists, flat):
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None)
        params = params if isinstance(params, dict) else {}
        started = rid in self.load_started
        self.load_started.discard(rid)
        if params.get("do_remote_prefill") and not started and rid not in self.loading:
            # Decode, ended (aborted) before vLLM allocated its blocks: the load never started.
            self._release(request, params, "decode request ended before its load started")
            return False, None
        if rid in self.loading:
            # Decode, finished (aborted) before its KV arrived: the workers stop the load and
            # report it received; vLLM keeps the blocks until then (finish_requests).
            entry = self.loading.pop(rid)
            if entry is not None:
                table, n, text = entry
                self.meta.finishes.append({"request_id": rid, "aborted": True, "blocks": table,
                                           "num_tokens": n, "params": text})
            return False, None
        if rid in self.pending_saves:
            del self.pending_saves[rid]  # never reached the workers
            return False, None
        if rid in self.saving:
            entry = self.saving.pop(rid)
            self.meta.finishes.append({
                "request_id": rid, "aborted": not _hands_off(request),
                "blocks": entry["blocks"], "num_tokens": entry["num_tokens"],
                "params": entry["params"]})
            self.holding.add(rid)
            return True, None
        if not params.get("do_remote_decode") or str(params.get("mode") or "") == "write":
            return False, None
        try:
            _kvwire.parse_kv_transfer_params(json.dumps(params))
        except (ValueError, TypeError) as e:
            logger.error("kvwire connector: request %s: bad kv_transfer_params: %s; no "
                         "hand-off, blocks freed", rid, e)
            return False, None
        if not _hands_off(request):
            return False, None  # aborted or failed: nothing to hand off
        if self.c._settings.mode == "write":
            logger.error("kvwire connector: request %s: read-mode hand-off but this engine is "
                         "'write'; blocks freed", rid)
            return False, None
        if 0 not in self.workers:
            logger.error("kvwire connector: request %s: no worker address yet (vLLM has not "
                         "called set_xfer_handshake_metadata); blocks freed", rid)
            return False, None
        table = self._table(lists)
        delay = any(len(ids) > 0 for ids in lists)
        tid = secrets.token_hex(16)  # the capability a reader presents: 128 random bits
        n = _prompt_len(request)
        by_index = all(name == str(i) for i, name in enumerate(self.c._names))
        blocks_out = [list(ids) for ids in lists] if by_index else table
        if flat and by_index and len(lists) == 1:
            blocks_out = list(lists[0])

        def where(m):
            host, _, port = m.address.rpartition(":")
            return (self.c._settings.host_ip or m.host or host), int(port)

        host, port = where(self.workers[0])
        out = {"do_remote_prefill": True, "do_remote_decode": False,
               "remote_engine_id": self.c.engine_id, "remote_host": host, "remote_port": port,
               "remote_block_ids": blocks_out, "remote_request_id": rid,
               "transfer_id": tid, "tp_size": self.c._tp_size, "mode": "read",
               "num_tokens": n}
        others = [r for r in sorted(self.workers) if r != 0]
        if others:
            out["tp_sources"] = []
            for r in others:
                h, p = where(self.workers[r])
                out["tp_sources"].append({"remote_engine_id": self.workers[r].engine_id,
                                          "remote_host": h, "remote_port": p,
                                          "transfer_id": tid, "remote_block_ids": blocks_out})
        if delay:
            self.meta.holds.append({"request_id": rid, "transfer_id": tid, "blocks": table,
                                    "num_tokens": n})
            self.holding.add(rid)
        return delay, out

    def update_connector_output(self, output) -> None:
        for rid in getattr(output, "finished_recving", None) or ():
            self.loading.pop(rid, None)
        for rid in getattr(output, "finished_sending", None) or ():
            self.holding.discard(rid)


# ---------------------------------------------------------------------------------------------
# Worker side: the native kvwire.Connector, its KV caches and transfers.
# ---------------------------------------------------------------------------------------------
class _WorkerSide:
    def __init__(self, conn: KvwireConnector):
        self.c = conn
        s = conn._settings
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.tp_rank = int(get_tensor_model_parallel_rank())
        except (ImportError, AssertionError, AttributeError):
            self.tp_rank = 0
        self.native = _kvwire.Connector(
            name=f"{conn.engine_id}/tp{self.tp_rank}", mode=s.mode, transport=s.transport,
            request_timeout_s=s.request_timeout_s, secret=s.secret,
            listen_address=s.listen_address, metrics_address=s.metrics_address,
            read_grants=s.read_grants)
        self.layout = None
        self.layer_of: dict = {}  # vLLM layer name -> model layer index
        self.names_of_layer: dict = {}  # model layer index -> its layer names
        # decode request -> the block ids its load fills (reported on failure; never the local
        # prefix blocks before them, which other requests may share)
        self.load_blocks: dict = {}
        self.loading: set = set()  # decode loads not reported yet
        self.sending: set = set()  # prefill requests the native holds or saves
        self.done_recving: set = set()  # reported by us, not by the native
        self.done_sending: set = set()
        self.failed_loads: dict = {}  # decode request -> its own blocks, failure not reported
        self.invalid: set = set()
        self.finished_seen: set = set()  # request ids vLLM has passed to get_finished
        self.unreported_sending: set = set()
        self.failed_saves: set = set()  # write mode saves the native refused
        self.saves_bound = False
        self.any_cache = None
        self.saved_names: set = set()
        self.sent_layers: set = set()
        self.events: list = []
        self.last_stats = {"completed": 0, "failed": 0, "bytes": 0}

    def handshake_metadata(self) -> KvwireHandshakeMetadata:
        host = self.native.address.rpartition(":")[0]
        return KvwireHandshakeMetadata(self.c.engine_id, self.native.address, self.tp_rank,
                                       self.c._settings.host_ip or host)

    # registration --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        from kvwire.vllm_layout import build_layout
        layout_json, memory, layer_of = build_layout(
            kv_caches, self.c._kv_cache_config, self.c._names, self.c._settings.groups,
            self.c._block_size, self.tp_rank, self.c._tp_size)
        self.layout = _kvwire.Layout.from_json(layout_json)
        mem = [_kvwire.KvMemory(ptr, length, kind, device) for ptr, length, kind, device in memory]
        self.native.register_kv_caches(self.layout, mem)
        self.layer_of = layer_of
        self.any_cache = next(iter(kv_caches.values()))
        self.names_of_layer = {}
        for name, idx in layer_of.items():
            self.names_of_layer.setdefault(idx, set()).add(name)
        logger.info("kvwire connector %s: registered %d caches in %d groups at %s",
                    self.c.engine_id, len(kv_caches), len(self.layout.groups),
                    self.native.address)

    # per step ------------------------------------------------------------------------------
    def bind(self, meta) -> None:
        if not isinstance(meta, KvwireConnectorMetadata):
            raise TypeError(f"kvwire connector: metadata of type {type(meta).__name__}")
        n = self.native
        self.saves_bound = False
        for f in meta.failed:
            rid = f["request_id"]
            logger.warning("kvwire connector: load of %s failed: %s", rid, f["reason"])
            self.done_recving.add(rid)
            self.failed_loads[rid] = list(f["block_ids"])
        for r in meta.releases:
            if self.tp_rank != 0:
                continue  # rank 0 tells every prefill rank (the params name them all)
            try:
                n.release_unread(r["request_id"], r["params"], r["reason"])
            except (ValueError, RuntimeError) as err:
                logger.warning("kvwire connector: cannot tell the prefill of %s to free its "
                               "blocks (its lease will): %s", r["request_id"], err)
        for e in meta.loads:
            rid = e["request_id"]
            own = _own_blocks(list(e["blocks"].values()), e["num_computed"], self.c._block_size)
            self.load_blocks[rid] = sorted({b for ids in own for b in ids})
            try:
                got, _ = n.get_num_new_matched_tokens(rid, e["num_tokens"], e["num_computed"],
                                                      e["params"])
                if got == 0:
                    raise ValueError("nothing to load")
                try:
                    n.update_state_after_alloc(rid, e["blocks"], got)
                except (ValueError, RuntimeError):
                    n.request_finished(rid, e["blocks"], e["num_tokens"], e["params"], True)
                    raise
                self.loading.add(rid)
            except (ValueError, RuntimeError) as err:
                logger.warning("kvwire connector: load of %s failed: %s", rid, err)
                self.done_recving.add(rid)
                self.failed_loads[rid] = self.load_blocks.pop(rid)
        for e in meta.saves:
            rid = e["request_id"]
            try:
                n.get_num_new_matched_tokens(rid, e["num_tokens"], 0, e["params"])
                try:
                    n.update_state_after_alloc(rid, e["blocks"], 0)
                except (ValueError, RuntimeError):
                    n.request_finished(rid, e["blocks"], e["num_tokens"], e["params"], True)
                    raise
                self.sending.add(rid)
                self.saves_bound = True
            except (ValueError, RuntimeError) as err:
                # The scheduler frees the blocks when the request finishes (delay, then
                # reported here as sent); decode's load fails at its deadline or on "fail".
                logger.error("kvwire connector: write-mode save of %s refused: %s", rid, err)
                self.failed_saves.add(rid)
        for e in meta.holds:
            rid = e["request_id"]
            try:
                delay, _ = n.request_finished(rid, e["blocks"], e["num_tokens"],
                                              '{"do_remote_decode": true, "mode": "read"}',
                                              False, e["transfer_id"])
                if delay:
                    self.sending.add(rid)
                else:
                    self.done_sending.add(rid)
            except (ValueError, RuntimeError) as err:
                logger.error("kvwire connector: cannot hold the blocks of %s: %s", rid, err)
                self.done_sending.add(rid)  # the scheduler kept them: free them now
        for e in meta.finishes:
            rid = e["request_id"]
            if rid in self.failed_saves:
                self.failed_saves.discard(rid)
                self.done_sending.add(rid)
                continue
            if rid not in self.loading and rid not in self.sending:
                continue  # already reported (or never started here)
            try:
                delay, _ = n.request_finished(rid, e["blocks"], e["num_tokens"], e["params"],
                                              bool(e["aborted"]))
            except (ValueError, RuntimeError) as err:
                logger.error("kvwire connector: finishing %s: %s", rid, err)
                delay = False
            if not delay:
                if rid in self.loading:
                    self.loading.discard(rid)
                    self.done_recving.add(rid)
                    self.load_blocks.pop(rid, None)
                elif rid in self.sending:
                    self.sending.discard(rid)
                    self.done_sending.add(rid)
        try:
            n.bind_connector_meta(n.build_connector_meta())
        except (ValueError, RuntimeError) as err:
            logger.error("kvwire connector: binding this step's metadata: %s", err)
        self.saved_names = set()
        self.sent_layers = set()

    def start_load_kv(self) -> None:
        try:
            self.native.start_load_kv()
        except (ValueError, RuntimeError) as err:
            logger.error("kvwire connector: start_load_kv: %s", err)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Nothing to wait for: every load is asynchronous (get_num_new_matched_tokens says so),
        # so vLLM schedules no request whose KV is still on the way; blocking here would only
        # hold up the forward pass of the others.
        return

    def _event_for(self, kv_layer):
        """A GPU event recorded on the current stream after the kernel that wrote the layer's
        KV (the send is ordered after it), or None for host memory."""
        if kv_layer is None or not getattr(kv_layer, "is_cuda", False):
            return None
        import torch
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(kv_layer.device))
        self.events.append(event)  # alive until wait_for_save
        return event, kv_layer.device.index or 0

    def _send_layer(self, idx: int, event) -> None:
        if idx in self.sent_layers:
            return
        self.sent_layers.add(idx)
        try:
            if event is None:
                self.native.save_kv_layer(idx)
            else:
                self.native.save_kv_layer(idx, int(event[0].cuda_event), event[1])
        except (ValueError, RuntimeError) as err:
            logger.error("kvwire connector: save_kv_layer(%d): %s", idx, err)

    def save_kv_layer(self, layer_name: str, kv_layer) -> None:
        if not self.saves_bound:
            return
        idx = self.layer_of.get(layer_name)
        if idx is None:
            return
        self.saved_names.add(layer_name)
        # A model layer goes out once every cache of it was written this step.
        if self.names_of_layer.get(idx, set()) <= self.saved_names:
            self._send_layer(idx, self._event_for(kv_layer))

    def wait_for_save(self) -> None:
        if self.saves_bound:
            # Layers whose caches did not all pass through save_kv_layer are final now, once
            # the work queued on the current stream so far has run.
            event = self._event_for(self.any_cache) if self.unsent_layers() else None
            for idx in self.unsent_layers():
                self._send_layer(idx, event)
            try:
                self.native.wait_for_save()
            except (ValueError, RuntimeError) as err:
                logger.error("kvwire connector: wait_for_save: %s", err)
        self.events = []
        self.saves_bound = False

    def unsent_layers(self) -> list:
        return [i for i in sorted(self.names_of_layer) if i not in self.sent_layers]

    def get_transfer_results(self, finished_req_ids, per_request: bool):
        """(finished sending, finished receiving, failed receiving). A failed load is also
        received (vLLM's contract). `per_request`: vLLM takes failures per request
        (failed_recving): with more than one KV cache group that is the only way (block ids
        are per group), so failures go there and never into the block ids; with one group
        they go as block ids (the blocks the load filled only), so vLLM keeps the valid local
        prefix. vLLM recomputes or fails the request per kv_load_failure_policy."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self.failed_loads = self.failed_loads, {}
        if per_request and len(self.c._names) > 1:
            return sending, recving, set(failed)
        for blocks in failed.values():
            self.invalid.update(blocks)
        return sending, recving, set()

    def get_finished(self, finished_req_ids):
        """(finished sending, finished receiving). A failed load is received and remembered
        in failed_loads (get_transfer_results reports it), never reported as a good load."""
        sending, recving, failed = self.native.get_finished()
        recving = set(recving) | self.done_recving
        self.done_recving = set()
        for rid, reason in failed:
            logger.warning("kvwire connector: load of %s failed: %s", rid, reason)
            recving.add(rid)
            self.failed_loads[rid] = self.load_blocks.get(rid, [])
        for rid in recving:
            self.loading.discard(rid)
            self.load_blocks.pop(rid, None)
        self.unreported_sending |= set(sending) | self.done_sending
        self.done_sending = set()
        # Only ids this worker may still report are remembered (others would pile up).
        self.finished_seen |= set(finished_req_ids or ()) & (self.sending |
                                                             self.unreported_sending |
                                                             self.failed_saves)
        # vLLM: a finished send must be of a request passed here as finished (now or before).
        out_sending = self.unreported_sending & self.finished_seen
        self.unreported_sending -= out_sending
        self.finished_seen -= out_sending
        self.sending -= out_sending
        return (out_sending or None), (recving or None)

    def take_load_errors(self) -> set:
        invalid, self.invalid = self.invalid, set()
        return invalid

    def interval_stats(self):
        s = json.loads(self.native.stats_json())
        now = {"completed": int(s.get("completed", 0)), "failed": int(s.get("failed", 0)),
               "bytes": sum(int(g.get("bytes", 0)) for g in (s.get("groups") or {}).values())}
        delta = {"requests_completed": now["completed"] - self.last_stats["completed"],
                 "requests_failed": now["failed"] - self.last_stats["failed"],
                 "bytes": now["bytes"] - self.last_stats["bytes"]}
        self.last_stats = now
        stats = KvwireConnectorStats(data=delta)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self.native = None
