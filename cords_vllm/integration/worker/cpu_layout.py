"""The KV accessor and codec of an attention layer: the CPU backend's tile layout, learnt through its own op.

vLLM's CPU attention packs each (block, head) as a K tile and a V tile whose element order depends on the
ISA it picked (``amx``: VNNI-packed, ``vec``: K transposed, ``vec16``, ...) and on the KV dtype. Rather than
hard-coding those, :func:`probe_cpu_tile_layout` writes token/dim index patterns through the backend's own
``cpu_attn_reshape_and_cache``, in the layer's own ``kv_cache_dtype`` (``fp8`` included), once per (isa, dtypes,
block size, head size), and reads back the permutation; :func:`accessor_for_layer` injects it into the pure
:class:`~cords_vllm.compress.kv_access.CPUTileAccessor`. GPU backends get the pure
:class:`~cords_vllm.compress.kv_access.PagedAccessor`. :func:`codec_for_layer` says what the stored elements
mean (:mod:`~cords_vllm.compress.kv_codec`), with the scales the layer's kernels use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from cords_vllm.compress.kv_access import CPUTileAccessor, KVAccessor, PagedAccessor
from cords_vllm.compress.kv_codec import FP8_KV_CACHE_DTYPES, KVCodec, codec_for

#: Values the layout probe writes for a 0 bit and a 1 bit (exact in every KV dtype, fp8 included).
_BIT_VALUES = (1.0, 2.0)


@functools.cache
def probe_cpu_tile_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int,
                          kv_cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Flat offsets of (token, dim) inside one CPU K tile and one V tile.

    ``dtype``: what the model writes (the cache's dtype too unless ``kv_cache_dtype`` quantises it). Each bit of
    the token index and of the dim index is written as 1 or 2 through the backend's own op (exact in fp8 with
    scale 1) and read back, so the layout is learnt in the layer's real storage format.

    Returns ``(k_perm, v_perm)``, each ``long [block_size, head_size]``: element ``(t, d)`` of a block's
    keys for one head lives at ``tile.reshape(-1)[k_perm[t, d]]``.
    """
    from vllm import _custom_ops as ops

    bs, d = block_size, head_size
    codec = codec_for(kv_cache_dtype)
    storage = torch.uint8 if kv_cache_dtype in FP8_KV_CACHE_DTYPES else dtype
    tok = torch.arange(bs).view(bs, 1, 1).expand(bs, 1, d)
    dim = torch.arange(d).view(1, 1, d).expand(bs, 1, d)
    low, high = _BIT_VALUES
    found = []
    for index, size in ((tok, bs), (dim, d)):
        decoded = [torch.zeros(bs * d, dtype=torch.long), torch.zeros(bs * d, dtype=torch.long)]
        for bit in range(max(1, (size - 1).bit_length())):
            kv = torch.zeros(1, 1, bs, 2 * d, dtype=storage)
            k_tile, v_tile = kv.view(1, 1, 2 * bs, d).chunk(2, dim=2)
            x = torch.where((index >> bit) & 1 == 1, high, low).to(dtype).contiguous()
            ops.cpu_attn_reshape_and_cache(x, x.clone(), k_tile, v_tile, torch.arange(bs, dtype=torch.int64), isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
            k_read, v_read = codec.features(k_tile[0, 0].reshape(-1), v_tile[0, 0].reshape(-1))
            for which, read in enumerate((k_read.float(), v_read.float())):
                if not bool(((read == low) | (read == high)).all()):
                    raise RuntimeError(f"KV layout probe for isa={isa!r}, kv_cache_dtype={kv_cache_dtype!r} left "
                                       "unwritten or unreadable elements")
                decoded[which] |= (read == high).long() << bit
        found.append(decoded)
    perms = []
    for which in (0, 1):
        tok_of, dim_of = found[0][which], found[1][which]
        perm = torch.full((bs, d), -1, dtype=torch.long)
        perm[tok_of, dim_of] = torch.arange(bs * d)
        if bool((perm < 0).any()):
            raise RuntimeError(f"KV layout probe for isa={isa!r} is not a permutation")
        perms.append(perm)
    return perms[0], perms[1]


def cpu_tile_accessor(kv_cache: torch.Tensor, isa: str, model_dtype: torch.dtype | None = None,
                      kv_cache_dtype: str = "auto") -> CPUTileAccessor:
    """The accessor of a CPU backend layer's ``[num_blocks, H, bs, 2 * D]`` cache packed for ``isa``.

    ``model_dtype``: what the model writes into it (default: the cache's dtype, as with ``kv_cache_dtype`` auto).
    """
    _, heads, bs, two_d = kv_cache.shape
    k_perm, v_perm = probe_cpu_tile_layout(isa, model_dtype or kv_cache.dtype, bs, two_d // 2, kv_cache_dtype)
    return CPUTileAccessor(block_size=bs, num_kv_heads=heads, head_size=two_d // 2,
                           k_perm=k_perm.to(kv_cache.device), v_perm=v_perm.to(kv_cache.device))


def _isa(layer: Any) -> str | None:
    return getattr(layer, "isa", None) or getattr(getattr(layer, "impl", None), "isa", None)


def kv_cache_dtype_of(layer: Any) -> str:
    """The layer's ``--kv-cache-dtype`` (``auto`` when it does not say)."""
    return str(getattr(layer, "kv_cache_dtype", "auto") or "auto")


def accessor_for_layer(kv_cache: torch.Tensor, layer: Any, model_dtype: torch.dtype | None = None
                       ) -> KVAccessor:
    """The accessor of one attention layer (``layer``: its vLLM ``Attention`` module)."""
    isa = _isa(layer)
    if isa is not None:
        return cpu_tile_accessor(kv_cache, isa, model_dtype, kv_cache_dtype_of(layer))
    head_size = getattr(layer, "head_size", None)
    if kv_cache.dim() == 4 and head_size is not None and kv_cache.shape[-1] == 2 * head_size:
        return PagedAccessor.of(kv_cache, head_size)
    raise NotImplementedError(
        f"cords-vllm cannot address this KV cache layout (shape {tuple(kv_cache.shape)}, "
        f"layer {type(layer).__name__}, --kv-cache-dtype {kv_cache_dtype_of(layer)}); supported: vLLM's CPU "
        "attention, FlashAttention, FlashInfer and Triton attention with a [num_blocks, H, block_size, "
        "2 * head_size] cache (--kv-cache-dtype auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2)")


def codec_for_layer(layer: Any) -> KVCodec:
    """What the layer's stored KV elements mean, with the scales its kernels use: the CPU backend's Python floats
    (``_k_scale_float``), the GPU backends' device tensors (``_k_scale``, read when decoding)."""
    kv_cache_dtype = kv_cache_dtype_of(layer)
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        return codec_for(kv_cache_dtype)
    if _isa(layer) is not None:
        scales = (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
    else:
        scales = (getattr(layer, "_k_scale", 1.0), getattr(layer, "_v_scale", 1.0))
    return codec_for(kv_cache_dtype, *scales, element=_fp8_element(kv_cache_dtype))


def _fp8_element(kv_cache_dtype: str) -> torch.dtype:
    """The fp8 element type the backends view the cache as (the platform's e4m3 flavour for ``fp8``)."""
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()
