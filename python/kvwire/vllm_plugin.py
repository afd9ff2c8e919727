"""vLLM plugin entry point (pyproject.toml: `vllm.general_plugins`, name "kvwire").

vLLM calls register() in each of its processes before it builds a KV connector, so
"kv_connector": "KvwireConnector" finds kvwire's class without kv_connector_module_path
(which keeps working: it names kvwire.vllm_connector directly).
"""
import logging

CONNECTOR_NAME = "KvwireConnector"
MODULE = "kvwire.vllm_connector"

logger = logging.getLogger("kvwire.vllm")


def register() -> None:
    """Registers KvwireConnector with vLLM's KVConnectorFactory (lazily: the module is
    imported when a connector is made). Safe to call more than once."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # kvwire installed without vLLM: nothing to register with
        return
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return  # registered already (vLLM loads plugins once per process, tests again)
    KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE, "KvwireConnector")
