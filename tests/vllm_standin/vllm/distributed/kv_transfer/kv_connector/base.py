"""vllm.distributed.kv_transfer.kv_connector.base (stand-in): the alias vLLM's model runner
checks connectors against (isinstance(connector, KVConnectorBase))."""
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

KVConnectorBase = KVConnectorBase_V1
