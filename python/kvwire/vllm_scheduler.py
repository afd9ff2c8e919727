"""kvwire's vLLM connector, scheduler side: no engine and no KV memory in this process.

The decisions are the native scheduler half's (_kvwire.SchedulerHalf,
include/kvwire/scheduler_half.h): matching of remote prefills, transfer ids, the
kv_transfer_params a prefill hands off, the bookkeeping of asynchronous loads and saves, and
what the workers must do each step. This class only turns vLLM's objects (Request,
KVCacheBlocks, SchedulerOutput, KVConnectorOutput) into its calls and its JSON into
KvwireConnectorMetadata, and logs what it reports (kvwire.vllm_connector's docstring tells the
whole protocol). It keeps no request state of its own."""
import json
import logging

import _kvwire
from kvwire.vllm_blocks import _block_lists, _hands_off, _prompt_len
from kvwire.vllm_metadata import KvwireConnectorMetadata, KvwireHandshakeMetadata

logger = logging.getLogger("kvwire.vllm")

_META_FIELDS = ("loads", "saves", "holds", "finishes", "failed", "releases")


def _params_json(request) -> str:
    """A request's kv_transfer_params as JSON for the native half ('' when it has none).
    Whatever a client sent: a value JSON cannot hold becomes its text (the native half then
    refuses it with a reason, as it refuses any bad field)."""
    params = getattr(request, "kv_transfer_params", None)
    if params is None:
        return ""
    try:
        return json.dumps(params, default=str)
    except (TypeError, ValueError) as e:  # e.g. a circular structure
        return json.dumps(f"unserializable kv_transfer_params: {e}")


def _lists_or_none(blocks) -> list:
    """vLLM's blocks as per-group lists; [] when they cannot be read (the native half then
    fails the load, with its reason, rather than leaving vLLM waiting for it)."""
    try:
        return _block_lists(blocks)
    except (TypeError, ValueError, AttributeError) as e:
        logger.error("kvwire connector: unreadable block lists (%s)", e)
        return []


def _int(value, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


class _SchedulerSide:
    def __init__(self, conn: "KvwireConnector"):
        self.c = conn
        self.native = _kvwire.SchedulerHalf(
            conn.engine_id, mode=conn._settings.mode, groups=list(conn._names),
            block_size=conn._block_size, tp_size=conn._tp_size,
            host_ip=conn._settings.host_ip or "")

    def _logged(self, result=None):
        for level, message in self.native.take_log():
            logger.log(level, "%s", message)
        return result

    # handshake ---------------------------------------------------------------------------
    def set_workers(self, metadata) -> None:
        workers = {}
        for rank, m in dict(metadata or {}).items():
            if not isinstance(m, KvwireHandshakeMetadata):
                raise ValueError(f"kvwire connector: handshake metadata of rank {rank} is "
                                 f"{type(m).__name__}, not KvwireHandshakeMetadata")
            workers[int(rank)] = (str(m.engine_id), str(m.address), str(m.host or ""))
        self.native.set_workers(workers)
        logger.info("kvwire connector %s: workers %s", self.c.engine_id,
                    {r: w[1] for r, w in sorted(workers.items())})

    @property
    def workers(self) -> dict:
        """tp rank -> KvwireHandshakeMetadata, as the native half holds them."""
        out = {}
        for rank in range(max(self.c._tp_size, 1)):
            w = self.native.worker(rank)
            if w is not None:
                out[rank] = KvwireHandshakeMetadata(w[0], w[1], rank, w[2])
        return out

    def pending_push_work(self) -> bool:
        return self.native.pending_push_work()

    def state(self) -> dict:
        """The native half's requests and transfer ids (tests, debugging)."""
        return json.loads(self.native.state_json())

    # vLLM's calls ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Decode (do_remote_prefill): the prompt tokens beyond the local prefix come from the
        prefill, asynchronously. No side effects (vLLM may call it again)."""
        if getattr(request, "kv_transfer_params", None) is None:
            return 0, False
        n, load_async = self.native.get_num_new_matched_tokens(
            request.request_id, _prompt_len(request), _int(num_computed_tokens),
            _params_json(request))
        return int(n), bool(load_async)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        # The native half never raises on what a request carries; only a request vLLM could
        # not have made (no id) gets here with an error, and it must not end vLLM's loop.
        try:
            if getattr(request, "kv_transfer_params", None) is None:
                return
            self.native.update_state_after_alloc(
                request.request_id, _prompt_len(request),
                _int(getattr(request, "num_computed_tokens", 0)), _params_json(request),
                _lists_or_none(blocks), _int(num_external_tokens))
        except Exception as e:  # noqa: BLE001 - a connector error must not end vLLM's loop
            logger.error("kvwire connector: update_state_after_alloc(%s): %s; no transfer",
                         getattr(request, "request_id", "?"), e)
        self._logged()

    def build_connector_meta(self, scheduler_output) -> KvwireConnectorMetadata:
        scheduled = dict(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
        computed, new_blocks = {}, {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            n = getattr(new, "num_computed_tokens", None)
            if n is not None:
                computed[new.req_id] = int(n)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            ids = list(getattr(cached, "req_ids", None) or [])
            for rid, nb in zip(ids, getattr(cached, "new_block_ids", None) or []):
                if nb is not None:
                    new_blocks[rid] = _block_lists(nb)
            for rid, n in zip(ids, getattr(cached, "num_computed_tokens", None) or []):
                computed[rid] = int(n)
        text = self.native.build_connector_meta(
            {str(k): int(v) for k, v in scheduled.items()}, computed, new_blocks)
        meta = KvwireConnectorMetadata()
        for field, entries in json.loads(text).items():
            if field in _META_FIELDS:
                setattr(meta, field, entries)
        return self._logged(meta)

    def request_finished(self, request, lists, flat=False):
        """(delay freeing the blocks, kv_transfer_params for the output). Never raises.
        `flat`: vLLM passed one flat list (no hybrid allocator); the params carry one too."""
        try:
            delay, params = self.native.request_finished(
                request.request_id, _prompt_len(request), _params_json(request),
                [list(map(int, ids)) for ids in lists], _hands_off(request), bool(flat))
        except Exception as e:  # noqa: BLE001 - a connector error must not end vLLM's loop
            logger.error("kvwire connector: request_finished(%s): %s; blocks freed now",
                         getattr(request, "request_id", "?"), e)
            return self._logged((False, None))
        return self._logged((bool(delay), json.loads(params) if params else None))

    def update_connector_output(self, output) -> None:
        self.native.update_connector_output(
            [str(r) for r in getattr(output, "finished_recving", None) or ()],
            [str(r) for r in getattr(output, "finished_sending", None) or ()])
