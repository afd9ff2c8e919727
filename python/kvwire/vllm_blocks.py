"""vLLM's requests, block lists, KV cache groups and layer names, as kvwire's connector reads
them."""
import re

from kvwire.vllm_settings import Settings

_LAYER_RE = re.compile(r"\d+")

_HAND_OFF_STATUSES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def _hands_off(request) -> bool:
    """The finish statuses vLLM's P/D connectors hand off on (NIXL's): the prefill ran to
    max_tokens (1), or its first token was a stop token (FINISHED_STOPPED; the prompt's KV is
    complete either way). Any other end (abort, error) frees the blocks at once."""
    status = getattr(request, "status", None)
    return getattr(status, "name", str(status)) in _HAND_OFF_STATUSES


def _own_blocks(lists, num_computed: int, block_size: int) -> list:
    """Per group, the blocks a load fills: those past the tokens already computed locally
    (the local prefix-cache hit, whole blocks, which other requests may share)."""
    skip = max(int(num_computed), 0) // max(int(block_size), 1)
    return [list(ids[skip:]) for ids in lists]


def _prompt_len(request) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(getattr(request, "prompt_token_ids", None) or [])
    return int(n)


def _block_lists(blocks) -> list:
    """KVCacheBlocks (or per-group lists, or one flat list) -> [[ids of group 0], ...]."""
    if hasattr(blocks, "get_block_ids"):
        blocks = blocks.get_block_ids()
    blocks = list(blocks)
    if blocks and not isinstance(blocks[0], (list, tuple)):
        return [[int(b) for b in blocks]]
    return [[int(b) for b in g] for g in blocks]


def _group_specs(kv_cache_config):
    return list(getattr(kv_cache_config, "kv_cache_groups", None) or [])


def _group_names(kv_cache_config, settings: Settings) -> list:
    """kvwire group name of each vLLM KV cache group: its index ("0", "1", ...; then
    kv_transfer_params carry vLLM's per-group lists), or the name set in extra config."""
    n = max(len(_group_specs(kv_cache_config)), 1)
    names = []
    for i in range(n):
        o = settings.groups[i] if i < len(settings.groups) else {}
        names.append(str(o.get("name", i)))
    if len(set(names)) != len(names):
        raise ValueError(f"kvwire connector: group names repeat: {names}")
    return names


def _layer_index(layer_name) -> int:
    """'model.layers.12.self_attn.attn' -> 12."""
    found = _LAYER_RE.findall(str(layer_name))
    if not found:
        raise ValueError(f"kvwire connector: no layer index in layer name {layer_name!r}")
    return int(found[0])
