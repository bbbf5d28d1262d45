"""Read and write whole tokens of one layer's paged KV cache, whatever the backend's packing (pure torch).

A *slot* is ``block_id * block_size + offset``. An accessor's ``read(cache, slots)`` returns the keys and
values of ``slots`` as two ``[T, H, D]`` tensors; ``write(cache, slots, keys, values)`` stores ``[T, H, D]``
keys/values there. ``slots`` must live on the cache's device; nothing here reads a tensor back to the host.

* :class:`PagedAccessor`: vLLM 0.32's GPU backends, FlashAttention, FlashInfer and Triton attention, all
  hand a layer a *logical* ``[num_blocks, H, block_size, 2 * D]`` view (keys in the first ``D`` channels,
  values after them) whatever the physical :class:`~vllm.v1.kv_cache_layout.KVCacheLayout` stride order
  (``LBHNC``, ``LBNHC``, ``BLHNC``, ...) behind it. The backends read it as
  ``kv_cache.transpose(1, 2).split(D, -1)`` (FlashAttention, Triton) or
  ``kv_cache.permute(layout.layer_view_order).split(D, -1)`` (FlashInfer); indexing the logical view
  addresses the same elements for every stride order.
* :class:`CPUTileAccessor`: vLLM's CPU attention packs ``[num_blocks, H, block_size, 2 * D]`` as a K tile
  and a V tile per (block, head) whose element order depends on the ISA. The tile permutations are learnt
  once through the backend's own op (``cords_vllm.integration.worker.cpu_layout``) and injected here, together with
  the backend's write op, so writes are exact by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

#: ``write(keys, values, k_tiles, v_tiles, slots)`` with ``[T, H, D]`` keys/values in the cache dtype.
TileWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class KVAccessor(Protocol):
    """Token-level access to one layer's paged KV cache."""

    block_size: int
    num_kv_heads: int
    head_size: int

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` (``long [T]`` on the cache's device): two ``[T, H, D]`` copies."""
        ...

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
              ) -> None:
        """Store ``[T, H, D]`` keys/values at ``slots``."""
        ...


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
        kv_cache[slots // self.block_size, :, slots % self.block_size] = torch.cat([keys, values], dim=-1).to(
            kv_cache.dtype)


@dataclass(frozen=True)
class CPUTileAccessor:
    """vLLM's CPU attention: per (block, head) a K tile then a V tile, each permuted as the ISA packs it.

    ``k_perm`` / ``v_perm``: ``long [bs, D]`` on the cache's device; element ``(t, d)`` of a block's keys for
    one head lives at ``tile.reshape(-1)[k_perm[t, d]]``. ``writer``: the backend's own write op.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    k_perm: torch.Tensor
    v_perm: torch.Tensor
    writer: TileWriter

    def _tiles(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, h, bs, d = kv_cache.shape[0], self.num_kv_heads, self.block_size, self.head_size
        k_tiles, v_tiles = kv_cache.view(n, h, 2 * bs, d).chunk(2, dim=2)
        return k_tiles, v_tiles

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not kv_cache.is_contiguous():
            raise ValueError("the CPU KV cache tensor of a layer must be contiguous")
        h, bs, d = self.num_kv_heads, self.block_size, self.head_size
        flat = kv_cache.reshape(-1)
        block, offset = slots // bs, slots % bs
        # (block, head) tile pair starts at ((block * H) + head) * 2*bs*D; the V tile is bs*D after the K tile
        heads = torch.arange(h, device=slots.device)
        base = ((block[:, None] * h + heads[None, :]) * (2 * bs * d))[:, :, None]  # [T, H, 1]
        keys = flat[base + self.k_perm[offset][:, None, :]]
        values = flat[base + bs * d + self.v_perm[offset][:, None, :]]
        return keys, values

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
              ) -> None:
        k_tiles, v_tiles = self._tiles(kv_cache)
        self.writer(keys.to(kv_cache.dtype).contiguous(), values.to(kv_cache.dtype).contiguous(), k_tiles,
                    v_tiles, slots)
