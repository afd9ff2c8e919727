"""vllm.v1.core.kv_cache_manager (stand-in): KVCacheBlocks as the scheduler passes it."""


class KVCacheBlock:
    def __init__(self, block_id: int):
        self.block_id = block_id


class KVCacheBlocks:
    """blocks[i]: the blocks of KV cache group i."""

    def __init__(self, blocks: tuple[list[KVCacheBlock], ...]):
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1
        return [b.block_id for b in self.blocks[0]]
