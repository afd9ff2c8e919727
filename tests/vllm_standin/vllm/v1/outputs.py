"""vllm.v1.outputs (stand-in): KVConnectorOutput as the workers return it."""
from dataclasses import dataclass, field


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: object | None = None
    kv_cache_events: object | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    expected_finished_count: int = 0
