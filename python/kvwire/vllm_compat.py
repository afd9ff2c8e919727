"""vLLM's connector base classes, or stand-ins when vLLM is not importable (so that kvwire's
plain Python API, and this package's modules, import without it). HAVE_VLLM says which."""
import dataclasses

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
