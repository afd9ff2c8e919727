"""A KV connector in the shape of vLLM's KVConnectorBase_V1, backed by kvwire.Connector.

vLLM itself is not needed: the class takes plain objects with the attributes vLLM passes
(request.request_id, request.num_tokens, request.kv_transfer_params; block ids as one list per
KV cache group, in the layout's group order). Each method maps one to one onto the native
connector:

  scheduler side: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
                  request_finished
  worker side:    register_kv_caches, bind_connector_metadata, clear_connector_metadata,
                  start_load_kv, wait_for_layer_load, save_kv_layer, wait_for_save,
                  get_finished

Scheduler and worker objects of one engine in one process share a native connector (looked
up by engine id), as vLLM's two roles share one deployment.
"""
import enum
import json
import os
import re
import stat
import threading

import _kvwire


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KvwireConnectorMetadata:
    """What the scheduler hands the workers each step (JSON, so it can cross processes)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return f"KvwireConnectorMetadata({self.text})"


_natives = {}
_natives_lock = threading.Lock()


def _read_secret_file(path: str) -> bytes:
    """A shared secret from a file, as kvwire-dsv4 and kvwire-perf read --secret-file: the
    bytes less one trailing newline; refused when others can read it or anyone but the owner
    (and group, read-only) can write it, or when it is empty or over 4 KiB."""
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


def _secret_for(extra: dict):
    """kv_connector_extra_config's secret_file (recommended: the config may be logged) or
    secret; None: the connector takes KVWIRE_SECRET from the environment, if set."""
    if extra.get("secret_file"):
        return _read_secret_file(extra["secret_file"])
    return extra.get("secret")


def _native_for(config: dict) -> "_kvwire.Connector":
    """One native connector per engine id in this process."""
    kv = config.get("kv_transfer_config", {})
    extra = kv.get("kv_connector_extra_config", {})
    engine_id = kv.get("engine_id", "")
    with _natives_lock:
        native = _natives.get(engine_id) if engine_id else None
        if native is None:
            native = _kvwire.Connector(
                name=engine_id,
                mode=extra.get("mode", "auto"),
                transport=extra.get("transport", "auto"),
                request_timeout_s=float(extra.get("request_timeout_s", 60.0)),
                secret=_secret_for(extra))
            if engine_id:
                _natives[engine_id] = native
        return native


def _event_handle(event):
    """(native handle, device) of a GPU event: an int handle, or a torch.cuda.Event."""
    if event is None:
        return None, 0
    if isinstance(event, int):
        return event, 0
    handle = getattr(event, "cuda_event", None)
    if handle is None:
        raise TypeError(f"save_kv_layer: not a GPU event: {event!r}")
    device = getattr(getattr(event, "device", None), "index", None)
    return int(handle), int(device or 0)


def _layer_index(layer_name) -> int:
    """'model.layers.12.self_attn.attn' -> 12; an int stays an int."""
    if isinstance(layer_name, int):
        return layer_name
    found = re.findall(r"\d+", str(layer_name))
    if not found:
        raise ValueError(f"no layer index in layer name {layer_name!r}")
    return int(found[0])


class KvwireConnector:
    """KVConnectorBase_V1-shaped connector over kvwire."""

    def __init__(self, vllm_config: dict, role: KVConnectorRole):
        self.role = role
        self._native = _native_for(vllm_config)
        self._layout = None
        self._group_names = list(vllm_config.get("kv_cache_groups", []))
        self._meta = None
        self._failed = {}
        self._events = []  # GPU events of saves not yet waited for (kept alive)

    @property
    def native(self):
        return self._native

    @property
    def engine_id(self) -> str:
        return self._native.engine_id

    @property
    def address(self) -> str:
        return self._native.address

    def _blocks(self, block_ids) -> dict:
        """Block ids as vLLM gives them (one list per group, or a dict) -> {group: ids}."""
        if isinstance(block_ids, dict):
            return {k: list(v) for k, v in block_ids.items()}
        if hasattr(block_ids, "get_block_ids"):
            block_ids = block_ids.get_block_ids()
        if len(block_ids) != len(self._group_names):
            raise ValueError(f"{len(block_ids)} block lists for groups {self._group_names}")
        return {g: list(ids) for g, ids in zip(self._group_names, block_ids)}

    @staticmethod
    def _params_json(request) -> str:
        params = getattr(request, "kv_transfer_params", None)
        if not params:
            return ""
        return params if isinstance(params, str) else json.dumps(params)

    # ---- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Returns (tokens the connector will load, whether they load asynchronously)."""
        return self._native.get_num_new_matched_tokens(
            request.request_id, request.num_tokens, num_computed_tokens,
            self._params_json(request))

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._native.update_state_after_alloc(request.request_id, self._blocks(blocks),
                                              num_external_tokens)

    def build_connector_meta(self, scheduler_output=None) -> KvwireConnectorMetadata:
        return KvwireConnectorMetadata(self._native.build_connector_meta())

    def request_finished(self, request, block_ids):
        """Returns (delay_free_blocks, kv_transfer_params for the decode or None)."""
        aborted = bool(getattr(request, "aborted", False))
        delay, params = self._native.request_finished(
            request.request_id, self._blocks(block_ids), request.num_tokens,
            self._params_json(request), aborted)
        return delay, (json.loads(params) if params else None)

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        """kv_caches: (kvwire.Layout with backing, [kvwire.Buffer or kvwire.KvMemory, ...]);
        GPU memory is kvwire.KvMemory(tensor.data_ptr(), nbytes, "gpu", device)."""
        layout, buffers = kv_caches
        self._layout = layout
        if not self._group_names:
            self._group_names = [g.name for g in layout.groups]
        self._native.register_kv_caches(layout, list(buffers))

    def set_kv_cache_groups(self, names):
        self._group_names = list(names)

    def bind_connector_metadata(self, metadata: KvwireConnectorMetadata):
        self._meta = metadata
        self._native.bind_connector_meta(metadata.text)

    def clear_connector_metadata(self):
        self._meta = None

    def start_load_kv(self, forward_context=None, **kwargs):
        self._native.start_load_kv()

    def wait_for_layer_load(self, layer_name):
        self._native.wait_for_layer_load(_layer_index(layer_name))

    def save_kv_layer(self, layer_name, kv_layer=None, attn_metadata=None, event=None,
                      **kwargs):
        """event: recorded on the compute stream after the layer's KV was written (an int
        handle or a torch.cuda.Event); the call returns at once and the layer goes out once
        the event completed. The event is kept alive here until wait_for_save()."""
        handle, device = _event_handle(event)
        if handle is not None:
            self._events.append(event)
        self._native.save_kv_layer(_layer_index(layer_name), handle, device)

    def wait_for_save(self):
        self._native.wait_for_save()
        self._events = []

    def get_finished(self, finished_req_ids=None):
        """Returns (finished_sending, finished_recving) as sets (None when empty). Failed
        loads count as received (the scheduler recomputes them); get_failed_loads() says why.
        """
        sending, recving, failed = self._native.get_finished()
        recving = set(recving)
        for request_id, reason in failed:
            self._failed[request_id] = reason
            recving.add(request_id)
        return (set(sending) or None), (recving or None)

    def get_failed_loads(self) -> dict:
        """Requests whose load failed since the last call, with the reason."""
        failed, self._failed = self._failed, {}
        return failed

    # ---- observability -----------------------------------------------------------------

    def stats(self) -> dict:
        return json.loads(self._native.stats_json())

    def prometheus(self) -> str:
        return self._native.stats_prometheus()
