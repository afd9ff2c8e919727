"""vllm.v1.kv_cache_interface (stand-in): the cache specs and KVCacheConfig."""
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: int | None = None

    @property
    def page_size_bytes(self) -> int:
        real = self.real_page_size_bytes
        return self.page_size_padded if self.page_size_padded is not None else real

    @property
    def real_page_size_bytes(self) -> int:
        return (2 * self.block_size * self.num_kv_heads * self.head_size
                * torch.tensor([], dtype=self.dtype).element_size())


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: str | None = None

    @property
    def real_page_size_bytes(self) -> int:
        if self.cache_dtype_str == "fp8_ds_mla":
            return self.block_size * 656
        return (self.block_size * self.num_kv_heads * self.head_size
                * torch.tensor([], dtype=self.dtype).element_size())


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
