"""kvwire: KV-cache transfer between prefill and decode.

The native module _kvwire (pybind11) provides Engine (and EngineOptions, Inbox), Layout, Buffer
and Connector (every ConnectorOptions field, etcd discovery and announce() included;
ConnectorOptions.from_environment reads the KVWIRE_* environment),
SchedulerHalf (the connector's scheduler decisions for a scheduler without an engine); vLLM
loads kvwire.vllm_connector.KvwireConnector as a KV connector (kv_connector_module_path).
"""
from _kvwire import (Buffer, CacheGroup, Connector, ConnectorOptions, Engine,  # noqa: F401
                     EngineOptions, Inbox, KvMemory, Layout, SchedulerHalf,
                     parse_kv_transfer_params, plan_transfer, select_blocks)
