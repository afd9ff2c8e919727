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
  - the scheduler-side connector has no engine and no memory: the native scheduler half
    (_kvwire.SchedulerHalf, include/kvwire/scheduler_half.h) decides per request (transfer
    ids, matching, kv_transfer_params, load bookkeeping) and says what the workers must do;
    vllm_scheduler.py turns vLLM's objects into its calls and its answer into
    KvwireConnectorMetadata, which vLLM sends to every worker each step. Workers report back through get_finished() and
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
# The connector class is here; its halves and parts live in sibling modules, one job each:
#   vllm_compat    vLLM's base classes (or stand-ins without vLLM), HAVE_VLLM
#   vllm_settings  kv_connector_extra_config keys and Settings
#   vllm_metadata  what crosses vLLM's processes: connector metadata, handshake, stats
#   vllm_blocks    vLLM's requests, block lists, groups and layer names as kvwire reads them
#   vllm_scheduler the scheduler side (_SchedulerSide, over _kvwire.SchedulerHalf)
#   vllm_worker    the worker side (_WorkerSide)
# Every name this module had before the split is still importable from it.
import json
import logging
import secrets

import _kvwire  # noqa: F401
from kvwire.vllm_blocks import (_HAND_OFF_STATUSES, _LAYER_RE, _block_lists,  # noqa: F401
                                _group_names, _group_specs, _hands_off, _layer_index,
                                _own_blocks, _prompt_len)
from kvwire.vllm_compat import (HAVE_VLLM, KVConnectorBase_V1,  # noqa: F401
                                KVConnectorHandshakeMetadata, KVConnectorMetadata,
                                KVConnectorRole, KVConnectorStats, KVConnectorTransferResults,
                                SupportsHMA)
from kvwire.vllm_metadata import (KvwireConnectorMetadata, KvwireConnectorStats,  # noqa: F401
                                  KvwireHandshakeMetadata)
from kvwire.vllm_scheduler import _SchedulerSide
from kvwire.vllm_settings import (EXTRA_CONFIG_KEYS, Settings, _flag,  # noqa: F401
                                  _read_secret_file)
from kvwire.vllm_worker import _WorkerSide

logger = logging.getLogger("kvwire.vllm")


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
