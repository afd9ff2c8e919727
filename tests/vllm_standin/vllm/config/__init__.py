"""vllm.config: the config objects a KV connector's constructor reads."""
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cuda"
    kv_role: str | None = None  # kv_producer | kv_consumer | kv_both
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "recompute"

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key, default) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool = False


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_index: int = 0


@dataclass
class ModelConfig:
    model: str = "toy"
    max_model_len: int = 4096
    use_mla: bool = False


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None
