"""kvwire: KV-cache transfer between prefill and decode.

The native module _kvwire (pybind11) provides Engine, Layout, Buffer and Connector; the
vLLM-shaped connector class lives in kvwire.vllm_connector.
"""
from _kvwire import (Buffer, CacheGroup, Connector, Engine, KvMemory,  # noqa: F401
                     Layout, parse_kv_transfer_params, plan_transfer, select_blocks)
