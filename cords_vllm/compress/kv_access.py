"""Read and write whole tokens of one layer's paged KV cache, whatever the backend's packing (pure torch).

A *slot* is ``block_id * block_size + offset``. An accessor's ``read(cache, slots)`` returns the keys and
values of ``slots`` as two ``[T, H, D]`` tensors *as stored* (the cache's dtype: ``uint8`` for an fp8 cache);
``write(cache, slots, keys, values)`` stores such ``[T, H, D]`` entries there, element for element. Moving kept
tokens is therefore exact for every KV dtype (no re-quantisation, scales untouched); what the elements mean is
:mod:`~cords_vllm.compress.kv_codec`'s business. ``slots`` must live on the cache's device; nothing here reads a
tensor back to the host.

* :class:`PagedAccessor`: vLLM 0.32's GPU backends, FlashAttention, FlashInfer and Triton attention, all
  hand a layer a *logical* ``[num_blocks, H, block_size, 2 * D]`` view (keys in the first ``D`` channels,
  values after them) whatever the physical :class:`~vllm.v1.kv_cache_layout.KVCacheLayout` stride order
  (``LBHNC``, ``LBNHC``, ``BLHNC``, ...) behind it. The backends read it as
  ``kv_cache.transpose(1, 2).split(D, -1)`` (FlashAttention, Triton) or
  ``kv_cache.permute(layout.layer_view_order).split(D, -1)`` (FlashInfer); indexing the logical view
  addresses the same elements for every stride order.
* :class:`CPUTileAccessor`: vLLM's CPU attention packs ``[num_blocks, H, block_size, 2 * D]`` as a K tile
  and a V tile per (block, head) whose element order depends on the ISA. The tile permutations are learnt
  once through the backend's own write op, in the layer's own KV dtype
  (``cords_vllm.integration.worker.cpu_layout``), and injected here; reads and writes index the tiles with them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch


class KVAccessor(Protocol):
    """Token-level access to one layer's paged KV cache."""

    block_size: int
    num_kv_heads: int
    head_size: int

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored keys and values of ``slots`` (``long [T]`` on the cache's device): two ``[T, H, D]`` copies in
        the cache's dtype."""
        ...

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
              ) -> None:
        """Store ``[T, H, D]`` keys/values, in the cache's dtype, at ``slots``."""
        ...

    def token_runs(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """Where the token at ``slots[h, i]`` (``long [H, n]``) keeps its keys and values for head ``h``, as runs of
        contiguous elements: per part of the token (keys and values together, or each alone), ``(runs, r)`` with
        ``runs`` ``long [H, n, w]`` the rows of :func:`run_view` ``(kv_cache, r)`` holding it, in channel order.
        Moving every part's rows moves the token, element for element."""
        ...

    def layout_key(self, kv_cache: torch.Tensor) -> tuple:
        """Equal for two layers whose caches :meth:`token_offsets` addresses alike (so offsets are shared)."""
        ...


def run_view(kv_cache: torch.Tensor, run: int) -> torch.Tensor:
    """``[N, run]``: ``kv_cache``'s storage from its first element on, whatever its strides, as rows of ``run``
    elements (what :meth:`KVAccessor.token_runs` index)."""
    n = kv_cache.untyped_storage().nbytes() // kv_cache.element_size() - kv_cache.storage_offset()
    return kv_cache.as_strided((n // run, run), (run, 1))


def run_length(perm: torch.Tensor) -> int:
    """The longest run ``r`` (a power of two dividing ``D``) such that ``perm`` (``long [bs, D]``) places every
    aligned group of ``r`` channels of a token at ``r`` consecutive elements starting at a multiple of ``r``."""
    bs, d = perm.shape
    r = d & -d  # the largest power of two dividing D
    while r > 1:
        starts = perm[:, ::r]
        if bool((starts % r == 0).all()) and bool(
                (perm.view(bs, d // r, r) == starts[..., None] + torch.arange(r, device=perm.device)).all()):
            return r
        r //= 2
    return 1


def slots_of(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """``long [len(blocks) * block_size]``: the slots of ``blocks`` (``long [n]``), in order, on their device."""
    offsets = torch.arange(block_size, device=blocks.device, dtype=torch.long)
    return (blocks.to(torch.long)[:, None] * block_size + offsets[None, :]).reshape(-1)


@dataclass(frozen=True)
class PagedAccessor:
    """FlashAttention / FlashInfer / Triton attention: a logical ``[N, H, bs, 2 * D]`` view, K then V."""

    block_size: int
    num_kv_heads: int
    head_size: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, head_size: int) -> PagedAccessor:
        """The accessor of a logical ``[N, H, bs, 2 * head_size]`` cache view."""
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
            raise ValueError(f"expected a [num_blocks, H, block_size, 2 * {head_size}] KV cache view, got shape "
                             f"{tuple(kv_cache.shape)}")
        return cls(block_size=kv_cache.shape[2], num_kv_heads=kv_cache.shape[1], head_size=head_size)

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = kv_cache[slots // self.block_size, :, slots % self.block_size]  # [T, H, 2*D]
        return tokens[..., : self.head_size], tokens[..., self.head_size:]

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
              ) -> None:
        kv_cache[slots // self.block_size, :, slots % self.block_size] = torch.cat([keys, values], dim=-1)

    def token_runs(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        s_block, s_head, s_offset, s_channel = kv_cache.stride()
        heads = torch.arange(self.num_kv_heads, device=slots.device)[:, None]
        base = (slots // self.block_size) * s_block + (slots % self.block_size) * s_offset + heads * s_head
        width = 2 * self.head_size
        if s_channel == 1 and all(x % width == 0 for x in (s_block, s_head, s_offset, kv_cache.storage_offset())):
            return [((base // width)[..., None], width)]  # a token's keys and values: one row of 2 * D
        return [(base[..., None] + torch.arange(width, device=slots.device) * s_channel, 1)]

    def layout_key(self, kv_cache: torch.Tensor) -> tuple:
        return "paged", self.block_size, self.num_kv_heads, self.head_size, tuple(kv_cache.stride())


@dataclass(frozen=True)
class CPUTileAccessor:
    """vLLM's CPU attention: per (block, head) a K tile then a V tile, each permuted as the ISA packs it.

    ``k_perm`` / ``v_perm``: ``long [bs, D]`` on the cache's device; element ``(t, d)`` of a block's keys for
    one head lives at ``tile.reshape(-1)[k_perm[t, d]]``.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    k_perm: torch.Tensor
    v_perm: torch.Tensor

    def _offsets(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat offsets ``long [T, H, D]`` of the keys and of the values of ``slots`` in ``kv_cache``."""
        if not kv_cache.is_contiguous():
            raise ValueError("the CPU KV cache tensor of a layer must be contiguous")
        h, bs, d = self.num_kv_heads, self.block_size, self.head_size
        block, offset = slots // bs, slots % bs
        # (block, head) tile pair starts at ((block * H) + head) * 2*bs*D; the V tile is bs*D after the K tile
        heads = torch.arange(h, device=slots.device)
        base = ((block[:, None] * h + heads[None, :]) * (2 * bs * d))[:, :, None]  # [T, H, 1]
        return base + self.k_perm[offset][:, None, :], base + bs * d + self.v_perm[offset][:, None, :]

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = kv_cache.reshape(-1)
        k_at, v_at = self._offsets(kv_cache, slots)
        return flat.index_select(0, k_at.reshape(-1)).view(k_at.shape), \
            flat.index_select(0, v_at.reshape(-1)).view(v_at.shape)

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
              ) -> None:
        flat = kv_cache.view(-1)
        k_at, v_at = self._offsets(kv_cache, slots)
        flat[k_at] = keys
        flat[v_at] = values

    def token_runs(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        if not kv_cache.is_contiguous():
            raise ValueError("the CPU KV cache tensor of a layer must be contiguous")
        h, bs, d = self.num_kv_heads, self.block_size, self.head_size
        heads = torch.arange(h, device=slots.device)[:, None]
        base = ((slots // bs * h + heads) * (2 * bs * d))[..., None]  # [H, n, 1]: the (block, head) K tile
        offset = slots % bs
        return [((base + tile) // r + starts[offset], r) for tile, (starts, r) in zip((0, bs * d), self.runs,
                                                                                   strict=True)]

    @functools.cached_property
    def runs(self) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]:
        """Per tile (keys, values): the rows of ``r`` elements each token offset's channels start in, within the
        tile (``long [bs, D / r]``), and ``r`` (:func:`run_length`: ISA packings keep some runs whole)."""
        out = []
        for perm in (self.k_perm, self.v_perm):
            r = run_length(perm)
            out.append((perm[:, ::r] // r, r))
        return out[0], out[1]

    def layout_key(self, kv_cache: torch.Tensor) -> tuple:
        return "cpu-tile", self.block_size, self.num_kv_heads, self.head_size, id(self.k_perm), id(self.v_perm)
