"""vllm.distributed.kv_transfer.kv_connector.v1 (stand-in): what it exports."""
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401 (exports)
    KVConnectorBase_V1, KVConnectorRole, SupportsHMA)

__all__ = ["KVConnectorBase_V1", "KVConnectorRole", "SupportsHMA"]
