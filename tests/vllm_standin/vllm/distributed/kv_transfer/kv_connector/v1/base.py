"""KVConnectorBase_V1 and its companions as vLLM declares them (stand-in, tests only).

Abstract methods are vLLM's abstract methods; the others have vLLM's defaults, so a
connector that forgets one behaves as it would in vLLM.
"""
import enum
from abc import ABC, abstractmethod
from typing import Any


class SupportsHMA(ABC):
    """The connector handles several KV cache groups (hybrid memory allocator)."""

    @abstractmethod
    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        raise NotImplementedError


def supports_hma(connector: Any) -> bool:
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
    """Out-of-band handshake metadata between P/D workers; must be serializable."""


class KVConnectorMetadata(ABC):  # noqa: B024
    """Scheduler connector -> worker connector, once per step."""


class KVConnectorWorkerMetadata(ABC):
    @abstractmethod
    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        pass


class KVConnectorBase_V1(ABC):
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is not None:
            self._kv_transfer_config = vllm_config.kv_transfer_config
        else:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ---- worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches):
        return

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend):
        return

    def set_host_xfer_buffer_ops(self, copy_operation):
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        return

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    @abstractmethod
    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def shutdown(self):
        return None

    def get_kv_connector_stats(self):
        return None

    def get_kv_connector_kv_cache_events(self):
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None

    # ---- scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        return

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        pass

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        pass

    @abstractmethod
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        pass

    def on_new_request(self, request) -> None:
        return

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def take_events(self):
        return ()

    def has_pending_push_work(self) -> bool:
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout should not be called "
                            "on the abstract base class")
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return False

    def get_finished_count(self) -> int | None:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        return None

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues):
        return None

    def reset_cache(self) -> bool | None:
        return None
