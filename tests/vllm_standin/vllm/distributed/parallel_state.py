"""vllm.distributed.parallel_state (stand-in): the worker's tensor-parallel rank and size.
Tests set them per worker process with set_tensor_model_parallel()."""
_rank = 0
_size = 1


def set_tensor_model_parallel(rank: int, size: int) -> None:  # stand-in only
    global _rank, _size
    _rank, _size = rank, size


def get_tensor_model_parallel_rank() -> int:
    return _rank


def get_tensor_model_parallel_world_size() -> int:
    return _size
