"""The KV accessor of an attention layer: the CPU backend's tile layout, learnt through its own op.

vLLM's CPU attention packs each (block, head) as a K tile and a V tile whose element order depends on the
ISA it picked (``amx``: VNNI-packed, ``vec``: K transposed, ``vec16``, ...). Rather than hard-coding
those, :func:`probe_cpu_tile_layout` writes token/dim index patterns through the backend's own
``cpu_attn_reshape_and_cache`` once per (isa, dtype, block size, head size) and reads back the
permutation; :func:`accessor_for_layer` injects it, and that op as the writer, into the pure
:class:`~cords_vllm.compress.kv_access.CPUTileAccessor`. GPU backends get the pure
:class:`~cords_vllm.compress.kv_access.PagedAccessor`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from cords_vllm.compress.kv_access import CPUTileAccessor, KVAccessor, PagedAccessor


@functools.cache
def probe_cpu_tile_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat offsets of (token, dim) inside one CPU K tile and one V tile.

    Returns ``(k_perm, v_perm)``, each ``long [block_size, head_size]``: element ``(t, d)`` of a block's
    keys for one head lives at ``tile.reshape(-1)[k_perm[t, d]]``.
    """
    from vllm import _custom_ops as ops

    bs, d = block_size, head_size
    if bs * max(bs, d) >= 1 << 24 and dtype != torch.float32:
        raise ValueError("block too large to probe exactly in a 16-bit dtype")
    readings = []
    for pattern in ("token", "dim"):
        kv = torch.zeros(1, 1, bs, 2 * d, dtype=dtype)
        k_tile, v_tile = kv.view(1, 1, 2 * bs, d).chunk(2, dim=2)
        tok = torch.arange(bs).view(bs, 1, 1).expand(bs, 1, d)
        dim = torch.arange(d).view(1, 1, d).expand(bs, 1, d)
        x = ((tok if pattern == "token" else dim) + 1).to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(x, x.clone(), k_tile, v_tile, torch.arange(bs, dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        readings.append((k_tile[0, 0].reshape(-1).float().long() - 1, v_tile[0, 0].reshape(-1).float().long() - 1))
    perms = []
    for which in (0, 1):
        tok_of, dim_of = readings[0][which], readings[1][which]
        if bool((tok_of < 0).any()) or bool((dim_of < 0).any()):
            raise RuntimeError(f"KV layout probe for isa={isa!r} left unwritten elements")
        perm = torch.full((bs, d), -1, dtype=torch.long)
        perm[tok_of, dim_of] = torch.arange(bs * d)
        if bool((perm < 0).any()):
            raise RuntimeError(f"KV layout probe for isa={isa!r} is not a permutation")
        perms.append(perm)
    return perms[0], perms[1]


def cpu_tile_writer(isa: str):
    """The CPU backend's own write op for ``isa``, as a :data:`~cords_vllm.compress.kv_access.TileWriter`."""
    from vllm import _custom_ops as ops

    def write(keys: torch.Tensor, values: torch.Tensor, k_tiles: torch.Tensor, v_tiles: torch.Tensor,
              slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(keys, values, k_tiles, v_tiles, slots.to(torch.int64), isa, k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")
    return write


def cpu_tile_accessor(kv_cache: torch.Tensor, isa: str) -> CPUTileAccessor:
    """The accessor of a CPU backend layer's ``[num_blocks, H, bs, 2 * D]`` cache packed for ``isa``."""
    _, heads, bs, two_d = kv_cache.shape
    k_perm, v_perm = probe_cpu_tile_layout(isa, kv_cache.dtype, bs, two_d // 2)
    return CPUTileAccessor(block_size=bs, num_kv_heads=heads, head_size=two_d // 2,
                           k_perm=k_perm.to(kv_cache.device), v_perm=v_perm.to(kv_cache.device),
                           writer=cpu_tile_writer(isa))


def accessor_for_layer(kv_cache: torch.Tensor, layer: Any) -> KVAccessor:
    """The accessor of one attention layer (``layer``: its vLLM ``Attention`` module)."""
    isa = getattr(layer, "isa", None) or getattr(getattr(layer, "impl", None), "isa", None)
    if isa is not None:
        return cpu_tile_accessor(kv_cache, isa)
    head_size = getattr(layer, "head_size", None)
    if kv_cache.dim() == 4 and head_size is not None and kv_cache.shape[-1] == 2 * head_size:
        return PagedAccessor.of(kv_cache, head_size)
    raise NotImplementedError(
        f"cords-vllm cannot address this KV cache layout (shape {tuple(kv_cache.shape)}, "
        f"layer {type(layer).__name__}); supported: vLLM's CPU attention, FlashAttention, FlashInfer and Triton "
        "attention with an unquantized [num_blocks, H, block_size, 2 * head_size] cache")
