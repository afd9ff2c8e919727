"""kvwire: KV-cache transfer between prefill and decode.

The native module _kvwire (pybind11) provides Engine, Layout, Buffer and Connector; vLLM
loads kvwire.vllm_connector.KvwireConnector as a KV connector (kv_connector_module_path).
"""
from _kvwire import (Buffer, CacheGroup, Connector, Engine, KvMemory,  # noqa: F401
                     Layout, parse_kv_transfer_params, plan_transfer, select_blocks)
