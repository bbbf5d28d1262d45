"""Read and write whole tokens of one layer's paged KV cache, whatever the backend's packing.

A *slot* is ``block_id * block_size + offset``. :meth:`KVLayout.read` returns the keys and values of a list of
slots as plain ``[T, H, D]`` tensors; :meth:`KVLayout.write` stores ``[T, H, D]`` keys/values into slots.

* **CPU** (``vllm/v1/attention/backends/cpu_attn.py``): a layer's cache is ``[num_blocks, H, bs, 2*D]``
  viewed as ``[num_blocks, H, 2*bs, D]`` and split into a K tile and a V tile per (block, head). Inside a tile
  the element order depends on the ISA the backend picked (``amx``: VNNI-packed, ``vec``: K transposed,
  ``vec16``...). Rather than hard-coding those, :func:`probe_cpu_tile_layout` writes token/dim index patterns
  through the backend's own ``cpu_attn_reshape_and_cache`` op once per (isa, dtype, block size, head size) and
  reads back the permutation. Writes always go through that same op, so they are exact by construction.
* **CUDA / FlashAttention**: the cache is ``[num_blocks, H, bs, 2*D]`` (possibly strided) with each token's
  key and value side by side, read by the backend as ``kv_cache.transpose(1, 2).split(D, -1)``; tokens are
  indexed directly on that logical view. (The CPU CI checks this against the backend's view expression; it
  has not run on a GPU in this project's CI.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


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


def slots_of(blocks: torch.Tensor | list[int] | tuple[int, ...], block_size: int, num_tokens: int | None = None
             ) -> torch.Tensor:
    """``long [T]`` slots of the tokens held by ``blocks``, in order (first ``num_tokens`` only if given)."""
    b = torch.as_tensor(blocks, dtype=torch.long)
    slots = (b[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)
    return slots if num_tokens is None else slots[:num_tokens]


@dataclass(frozen=True)
class KVLayout:
    """How to address tokens in one layer's cache tensor.

    ``backend``: ``"cpu"`` (packed tiles, ``isa`` required) or ``"flash"`` (``[N, H, bs, 2*D]``, K then V).
    """

    backend: str
    block_size: int
    num_kv_heads: int
    head_size: int
    isa: str | None = None

    @classmethod
    def for_layer(cls, kv_cache: torch.Tensor, layer: object) -> KVLayout:
        """Infer the layout from a layer's cache tensor and attention module."""
        isa = getattr(layer, "isa", None)
        if isa is not None:
            _, heads, bs, two_d = kv_cache.shape
            return cls("cpu", bs, heads, two_d // 2, isa)
        head_size = getattr(layer, "head_size", None)
        if kv_cache.dim() == 4 and head_size is not None and kv_cache.shape[-1] == 2 * head_size:
            _, heads, bs, _ = kv_cache.shape
            return cls("flash", bs, heads, head_size)
        raise NotImplementedError(
            f"cords-vllm cannot address this KV cache layout (shape {tuple(kv_cache.shape)}, "
            f"layer {type(layer).__name__}); supported: vLLM's CPU attention and FlashAttention")

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots``: two ``[T, H, D]`` tensors (copies, cache dtype)."""
        slots = slots.to(kv_cache.device)
        if self.backend == "flash":
            block, offset = slots // self.block_size, slots % self.block_size
            tokens = kv_cache[block, :, offset]  # [T, H, 2*D]
            return tokens[..., : self.head_size], tokens[..., self.head_size:]
        k_perm, v_perm = probe_cpu_tile_layout(self.isa, kv_cache.dtype, self.block_size, self.head_size)
        h, bs, d = self.num_kv_heads, self.block_size, self.head_size
        if not kv_cache.is_contiguous():
            raise ValueError("the CPU KV cache tensor of a layer must be contiguous")
        flat = kv_cache.reshape(-1)
        block, offset = slots // bs, slots % bs
        # (block, head) tile pair starts at ((block * H) + head) * 2*bs*D; the V tile is bs*D after the K tile
        base = (block[:, None] * h + torch.arange(h, device=slots.device)[None, :]) * (2 * bs * d)  # [T, H]
        keys = flat[base[:, :, None] + k_perm.to(slots.device)[offset][:, None, :]]
        values = flat[base[:, :, None] + bs * d + v_perm.to(slots.device)[offset][:, None, :]]
        return keys, values

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``[T, H, D]`` keys/values at ``slots``."""
        slots = slots.to(kv_cache.device)
        if self.backend == "flash":
            block, offset = slots // self.block_size, slots % self.block_size
            kv_cache[block, :, offset] = torch.cat([keys, values], dim=-1).to(kv_cache.dtype)
            return
        from vllm import _custom_ops as ops

        n, h, bs, d = kv_cache.shape[0], self.num_kv_heads, self.block_size, self.head_size
        k_tiles, v_tiles = kv_cache.view(n, h, 2 * bs, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys.to(kv_cache.dtype).contiguous(), values.to(kv_cache.dtype).contiguous(),
                                       k_tiles, v_tiles, slots.to(torch.int64), self.isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
