"""The kvwire layout of vLLM's KV cache tensors (register_kv_caches).

vLLM hands a worker connector {layer name: tensor}; kv_cache_config says which layers form
each KV cache group and the group's spec (block size, heads, head size, window). kvwire needs,
per group: the layers, tokens per block, the bytes of one page (one block of one layer, one
component), where each layer's block 0 starts, the stride between blocks and between the K and
V pages, and how heads lie in a page (for a tensor-parallel split). All of it is read from the
tensors' shape, dtype, strides and data pointers; anything kvwire cannot express (a page that
is not one contiguous range, layers of one group with different strides) is refused with the
layer named.

Logical shapes vLLM's attention backends use (strides may permute the last three dims: HND):
  MHA/GQA, K and V apart:  (2, num_blocks, block_size, heads, head_size)   flash-attn
                           (num_blocks, 2, block_size, heads, head_size)   flashinfer and others
  MHA/GQA on vLLM's CPU:   (num_blocks, heads, block_size, 2 * head_size)  cpu_attn: per head
                           its block's K (transposed by its kernels), then its V rows; one
                           dense page a block
  MLA (one latent vector): (num_blocks, block_size, head_size) or with a heads dim of 1
  other specs (e.g. DeepSeek-V4's compressed caches): (num_blocks, ...) one dense page a block
"""
import functools
import json
import logging

logger = logging.getLogger("kvwire.vllm")


def _spec_kind(spec) -> str:
    names = [c.__name__ for c in type(spec).__mro__]
    if any("Mamba" in n for n in names):
        return "mamba"
    if any("MLA" in n for n in names):
        return "mla"
    if hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size"):
        return "mha"
    return "other"


def _window(spec, override) -> int:
    if "window_tokens" in override:
        return int(override["window_tokens"])
    names = [c.__name__ for c in type(spec).__mro__]
    if any("SlidingWindow" in n for n in names):
        return int(getattr(spec, "sliding_window", 0) or 0)
    return 0


def _dense_inner(shape, strides, dims, what):
    """Elements of one page made of `dims`, checked to be one contiguous range."""
    span = 1
    for d in sorted((d for d in dims if shape[d] != 1), key=lambda d: strides[d]):
        if strides[d] != span:
            raise ValueError(f"{what}: a page is not one contiguous range (shape "
                             f"{tuple(shape)}, stride {tuple(strides)})")
        span *= shape[d]
    return span


@functools.lru_cache(maxsize=None)
def _cpu_attn_sections(dtype, block_size, d, es, heads):
    """section_row_bytes of vLLM's CPU attention pages, or None when unknown.

    The page of one head is (2 * block_size, head_size) as the backend views it, K then V,
    but its kernels (ISA "vec" on x86 without AMX) keep K transposed, element e of slot s at
    e * block_size + s, and V token-major. That is checked here, not assumed: one token is
    written with the backend's own cpu_attn_reshape_and_cache into a one-head cache at the
    first and the last slot, and the bytes it touched must be exactly those rows. Anything
    else (another ISA's packing, an op that moved) gives None: kvwire then refuses to grant a
    partly filled block rather than clear the wrong bytes.
    """
    try:
        import torch
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        isa = _get_attn_isa(dtype, block_size, d)
        for slot in (0, block_size - 1):
            cache = torch.zeros((1, 1, block_size, 2 * d), dtype=dtype)
            k_cache, v_cache = cache.view((1, 1, 2 * block_size, d)).chunk(2, dim=2)
            one = torch.ones((1, 1, d), dtype=dtype)
            ops.cpu_attn_reshape_and_cache(one, one, k_cache, v_cache,
                                           torch.tensor([slot], dtype=torch.long), isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
            touched = set((cache.flatten() != 0).nonzero().flatten().tolist())
            expect = ({e * block_size + slot for e in range(d)}
                      | {block_size * d + slot * d + e for e in range(d)})
            if touched != expect:
                logger.warning("kvwire: vLLM CPU attention (ISA %s) keeps a token's K/V in "
                               "a way kvwire does not know; read grants refuse partly filled "
                               "blocks", isa)
                return None
    except Exception as e:  # noqa: BLE001 - unknown placement is refused later, not guessed
        logger.warning("kvwire: cannot check vLLM CPU attention's K/V placement (%s)", e)
        return None
    # Per head: head_size sections of one element a slot (K, transposed), then one section of
    # head_size elements a slot (V).
    return tuple(([es] * d + [d * es]) * heads)


def _analyze(name, t, spec, kind, tp_rank, tp_size):
    """One layer's tensor -> its group fields and base address."""
    shape, strides, es = tuple(t.shape), tuple(t.stride()), t.element_size()
    what = f"kvwire connector: layer {name!r}"
    # A replicated page (MLA, one latent vector; no heads split) still names this worker's
    # tensor-parallel place: a prefill expects one reader per decode rank (the largest
    # tp_size of the decode's layout) and gives each rank one place.
    heads = {"total": 0, "tp_size": tp_size, "tp_rank": tp_rank, "outer": 1, "inner_bytes": 0}
    block_size = int(spec.block_size)
    if kind == "mha" and len(shape) == 4:
        # vLLM's CPU attention (cpu_attn.py): (blocks, heads, block_size, 2 * head_size), each
        # head's K rows then its V rows (the backend views it as (blocks, heads, 2 * block_size,
        # head_size)). One dense page a block; a head's slice is its K and V together.
        h, d = int(spec.num_kv_heads), int(spec.head_size)
        if shape[1:] != (h, block_size, 2 * d):
            raise ValueError(f"{what}: an attention cache of shape {shape} (expected (2, "
                             f"blocks, block_size, heads, head_size), (blocks, 2, ...) or vLLM "
                             f"CPU's (blocks, {h} heads, {block_size}, 2 * {d}))")
        page_elems = _dense_inner(shape, strides, (1, 2, 3), what)
        heads = {"total": h * tp_size, "tp_size": tp_size, "tp_rank": tp_rank, "outer": 1,
                 "inner_bytes": 2 * block_size * d * es}
        bdim, comps, cstride, block_major = 0, 1, 0, True
        # Where a token's K and V lie inside a head's part of the page is the attention
        # kernel's business (its ISA's): found by writing a token with vLLM's own op.
        # Probed once per shape (lru_cache), not once per layer.
        sections = _cpu_attn_sections(t.dtype, block_size, d, es, h)
        sections = list(sections) if sections is not None else None
    elif kind == "mha":
        if len(shape) != 5:
            raise ValueError(f"{what}: an attention cache of shape {shape} (expected "
                             f"(2, blocks, block_size, heads, head_size) or (blocks, 2, ...))")
        if shape[0] == 2 and shape[2] == block_size:
            cdim, bdim = 0, 1
        elif shape[1] == 2 and shape[2] == block_size:
            cdim, bdim = 1, 0
        else:
            raise ValueError(f"{what}: cannot find the K/V and block dims in shape {shape} "
                             f"(block size {block_size})")
        h, d = int(spec.num_kv_heads), int(spec.head_size)
        if shape[3] != h or shape[4] != d:
            raise ValueError(f"{what}: shape {shape} does not hold {h} heads of {d}")
        if strides[4] != 1:
            raise ValueError(f"{what}: head_size is not the innermost dim (stride {strides})")
        page_elems = _dense_inner(shape, strides, (2, 3, 4), what)
        sections = None  # kvwire derives it from the head split (NHD or HND)
        hnd = strides[3] > strides[2]  # heads outside tokens inside a page
        heads = {"total": h * tp_size, "tp_size": tp_size, "tp_rank": tp_rank,
                 "outer": 1 if hnd else block_size,
                 "inner_bytes": (block_size * d if hnd else d) * es}
        comps, cstride = 2, strides[cdim] * es
        block_major = bdim < cdim
    else:
        if len(shape) < 2:
            raise ValueError(f"{what}: cannot map a cache of shape {shape}")
        bdim = 0
        page_elems = _dense_inner(shape, strides, tuple(range(1, len(shape))), what)
        comps, cstride, block_major = 1, 0, True
        sections = None
        # MLA, (blocks, block_size, [1,] head_size) with tokens outermost in a page: one row
        # a token. Other caches (e.g. DeepSeek-V4's byte pages): unknown here; the extra
        # config's groups[i].section_row_bytes says it (read grants refuse partly filled
        # blocks without it).
        if (kind == "mla" and len(shape) >= 3 and shape[1] == block_size
                and strides[1] == max(strides[1:])):
            sections = [page_elems * es // block_size]
    page_bytes = page_elems * es
    want = int(getattr(spec, "page_size_bytes", 0) or 0)
    if want and page_bytes * comps > want:
        raise ValueError(f"{what}: pages of {page_bytes * comps} bytes but the cache spec "
                         f"says {want}")
    fields = {"page_bytes": page_bytes, "components": comps, "block_major": block_major,
              "heads": heads, "num_blocks": shape[bdim], "block_stride": strides[bdim] * es,
              "component_stride": cstride}
    if sections:
        fields["section_row_bytes"] = sections
    return fields, t.data_ptr()


def _storage_span(t):
    """(address, bytes) of the whole memory behind `t` (layers may share one allocation)."""
    if hasattr(t, "untyped_storage"):
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    s = t.storage()  # torch < 2.0
    return s.data_ptr(), s.size() * s.element_size()


def _layer_index(layer_name) -> int:
    from kvwire.vllm_connector import _layer_index as index
    return index(layer_name)


def build_layout(kv_caches, kv_cache_config, names, overrides, block_size, tp_rank, tp_size):
    """(layout JSON, [(ptr, length, kind, device)], {layer name: model layer index})."""
    if not isinstance(kv_caches, dict) or not kv_caches:
        raise ValueError("kvwire connector: register_kv_caches needs {layer name: tensor}")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        raise ValueError("kvwire connector: no kv_cache_config groups (vLLM passes "
                         "kv_cache_config to the connector's constructor)")
    out_groups, memory, layer_of, seen_mem = [], [], {}, set()
    for gi, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = _spec_kind(spec)
        o = overrides[gi] if gi < len(overrides) else {}
        if kind == "mamba" and not o.get("per_request_state"):
            raise ValueError(f"kvwire connector: KV cache group {gi} is a Mamba state "
                             f"({type(spec).__name__}); kvwire cannot map it")
        fields, layers, bases = None, [], []
        for lname in group.layer_names:
            if lname not in kv_caches:
                raise ValueError(f"kvwire connector: layer {lname!r} of KV cache group {gi} "
                                 "has no tensor in kv_caches")
            t = kv_caches[lname]
            f, base = _analyze(lname, t, spec, "other" if kind == "mamba" else kind, tp_rank,
                               tp_size)
            if fields is None:
                fields = f
            elif f != fields:
                diff = {k: (fields[k], f[k]) for k in f if f[k] != fields[k]}
                raise ValueError(f"kvwire connector: layer {lname!r} of KV cache group {gi} "
                                 f"is laid out unlike the group's first layer: {diff}")
            idx = _layer_index(lname)
            if idx in layers:
                raise ValueError(f"kvwire connector: two caches of model layer {idx} in KV "
                                 f"cache group {gi} ({lname!r})")
            layers.append(idx)
            bases.append(base)
            layer_of[lname] = idx
            key = _storage_span(t)
            if key not in seen_mem:
                seen_mem.add(key)
                gpu = bool(getattr(t, "is_cuda", False))
                memory.append((key[0], key[1], "gpu" if gpu else "host",
                               (t.device.index or 0) if gpu else -1))
        order = sorted(range(len(layers)), key=lambda i: layers[i])
        g = {"name": names[gi], "layers": [layers[i] for i in order],
             "tokens_per_block": int(spec.block_size),
             "tokens_per_entry": int(o.get("tokens_per_entry",
                                           getattr(spec, "compress_ratio", 1) or 1)),
             "window_tokens": _window(spec, o),
             "per_request_state": bool(o.get("per_request_state", False)),
             "layer_base": [bases[i] for i in order]}
        g.update(fields)
        if o.get("section_row_bytes"):
            g["section_row_bytes"] = [int(b) for b in o["section_row_bytes"]]
        out_groups.append(g)
    extra = sorted(set(kv_caches) - set(layer_of))
    if extra:
        raise ValueError(f"kvwire connector: kv_caches has layers in no KV cache group: {extra}")
    return json.dumps({"model": "vllm", "groups": out_groups}), memory, layer_of
