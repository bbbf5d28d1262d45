"""The compress step's copy as one Triton kernel: every layer's kept tokens, keys and values, in one launch.

The kernel beside its reference, the per-layer loop at the end of :func:`~cords_vllm.compress.step.compress_region`
(``accessor.read`` of the region, advanced indexing by the kept positions, ``accessor.write``), which stays the
CPU path and the reference.

What it moves: for every layer ``l``, KV head ``h`` and kept row ``i``, the ``2 * D`` stored elements of the token
in source row ``pos[a(l), h, i]`` (``a(l)``: the layer's anchor) to destination row ``i``, raw (the cache's
elements reinterpreted as integers of their width: bf16, fp16, fp32 and fp8 bytes alike, never converted, so
scales and NaN payloads survive). Each layer's cache is addressed from the first one by its element offset, so a
layer count of any size is one launch; caches of different dtypes or strides are grouped, one launch per group
(vLLM gives every attention layer of a KV-cache group the same layout).

In place without a scratch copy: destination row ``i`` is source row ``i`` (the kept tokens go to the first
source blocks, :class:`~cords_vllm.compress.step.RegionBatch`'s rule) and kept positions increase, so
``pos[i] >= i``: row ``i`` is read only by rows ``i' <= i``. One program owns a (layer, head, channel chunk)
and walks its rows in order, a tile at a time, loading the whole tile before storing it (a barrier between), so no
row is overwritten before every row that reads it has been read. Programs own disjoint elements.

Layouts: the logical ``[num_blocks, H, block_size, 2 * D]`` view of vLLM 0.32's GPU backends
(:class:`~cords_vllm.compress.kv_access.PagedAccessor`) with any physical stride order; the strides come from the
view, so every :class:`~vllm.v1.kv_cache_layout.KVCacheLayout` is the same kernel.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cords_vllm.kernel_backend import interpreting, launch
from cords_vllm.selection.triton_jit import jitted, kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

#: Rows per tile, channel bytes per program and warps per program of the copy: the fastest of 18 settings on an H100
#: at a 7B model's shape (0.37 ms against 0.40-0.60 ms, one at 4.0 ms; its floor 0.27 ms), with 16-byte accesses.
TILE_ROWS, CHUNK_BYTES, WARPS = 128, 128, 4
#: The copy's arguments Triton must not specialize, so that a compression of another size compiles nothing: the kept
#: count and the kept positions' strides (which Triton would otherwise compile a variant for at the value 1 and at
#: multiples of 16) and the positions and slots, which may be views at varying offsets (alignment).
NOT_SPECIALIZED = (("num_keep", "pos_s_anchor", "pos_s_head"), ("pos_ptr", "src_ptr", "dst_ptr"))
#: Integer dtype of each element width: the kernel moves raw elements.
_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@kernel(*NOT_SPECIALIZED)
def _copy_kernel(base_ptr, offsets_ptr, rows_ptr, pos_ptr, src_ptr, dst_ptr,
                 num_keep, heads, channels,
                 s_block, s_head, s_offset, s_channel, pos_s_anchor, pos_s_head, pos_s_row,
                 BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr):
    """Program (layer * heads + head, channel chunk): rows ``0 .. num_keep`` of that head, a tile at a time, in
    order. Tile ``b + 1`` is read before tile ``b`` is written: it reads rows ``>= (b + 1) * BLOCK_T``, which tile
    ``b`` does not write, so the next tile's reads overlap this one's writes.

    ``ALIGN``: every token's channels start at a multiple of ``ALIGN`` elements (16 bytes, checked by the caller:
    the layers' offsets, the strides, the channel count), so the compiler moves 16 bytes per access instead of one
    element (the layers' offsets are read from memory, which it cannot see into); 1 where that does not hold."""
    pid = tl.program_id(0)
    layer = pid // heads
    head = (pid % heads).to(tl.int64)
    cache = base_ptr + tl.multiple_of(tl.load(offsets_ptr + layer), ALIGN)
    pos_row = pos_ptr + tl.load(rows_ptr + layer) * pos_s_anchor + head * pos_s_head
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_off = (ch.to(tl.int64) * s_channel)[None, :]
    ch_in = (ch < channels)[None, :]
    rows = tl.arange(0, BLOCK_T)

    t_in = rows < num_keep
    src = tl.load(src_ptr + tl.load(pos_row + rows * pos_s_row, mask=t_in, other=0), mask=t_in, other=0)
    src_at = tl.multiple_of((src // BLOCK_SIZE) * s_block + head * s_head + (src % BLOCK_SIZE) * s_offset, ALIGN)
    tile = tl.load(cache + src_at[:, None] + ch_off, mask=t_in[:, None] & ch_in)
    for t0 in range(0, num_keep, BLOCK_T):
        t = t0 + rows
        t_in = t < num_keep
        dst = tl.load(dst_ptr + t, mask=t_in, other=0)
        dst_at = tl.multiple_of((dst // BLOCK_SIZE) * s_block + head * s_head + (dst % BLOCK_SIZE) * s_offset, ALIGN)
        n = t + BLOCK_T  # the next tile, read ahead
        n_in = n < num_keep
        src = tl.load(src_ptr + tl.load(pos_row + n * pos_s_row, mask=n_in, other=0), mask=n_in, other=0)
        src_at = tl.multiple_of((src // BLOCK_SIZE) * s_block + head * s_head + (src % BLOCK_SIZE) * s_offset, ALIGN)
        ahead = tl.load(cache + src_at[:, None] + ch_off, mask=n_in[:, None] & ch_in)
        tl.debug_barrier()  # every thread has read this tile before any of it is written
        tl.store(cache + dst_at[:, None] + ch_off, tile, mask=t_in[:, None] & ch_in)
        tile = ahead


def compiled(interpret: bool):
    """The copy, jitted on first use (under the interpreter when ``TRITON_INTERPRET=1`` at that time), with the
    arguments of :data:`NOT_SPECIALIZED` left unspecialized."""
    return jitted(_copy_kernel, interpret)


@functools.cache
def device_table(values: tuple[int | float, ...], device: torch.device, dtype: torch.dtype = torch.long
                  ) -> torch.Tensor:
    """Device copy of a small host table (``long`` unless ``dtype`` says otherwise), made once per (table, device,
    dtype): the caches, and so their offsets, live as long as the engine."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def cache_signature(cache: torch.Tensor) -> tuple:
    return cache.dtype, tuple(cache.shape), tuple(cache.stride()), cache.device


@dataclass(frozen=True)
class _Group:
    """Layers of one layout, moved by one launch: their indices, every layer's element offset from the first one's
    tokens (a device table), and the launch's settings that follow from the layout."""

    layers: tuple[int, ...]
    offsets: torch.Tensor
    block_c: int
    grid: tuple[int, int]
    align: int


@dataclass(frozen=True)
class _Layout:
    """The copy's groups of a list of caches (:func:`_layout`), with what tells that list again: a weak reference to
    each cache tensor and each one's address (a tensor given new storage in place moves)."""

    caches: tuple[weakref.ref, ...]
    addresses: tuple[int, ...]
    groups: tuple[_Group, ...]

    def of(self, caches: Sequence[torch.Tensor]) -> bool:
        return (len(caches) == len(self.caches)
                and all(ref() is cache for ref, cache in zip(self.caches, caches, strict=True))
                and tuple(cache.data_ptr() for cache in caches) == self.addresses)


_LAST: list[_Layout] = []


def _layout(caches: Sequence[torch.Tensor]) -> tuple[_Group, ...]:
    """The layers grouped by layout, each group's offsets and launch settings: worked out once per list of cache
    tensors (an engine's, which live as long as it: 28 layers' shapes, strides and addresses were a quarter of the
    fused step's host time per compression), and again for any other list. Keeps weak references only: a cache the
    engine frees is not held here."""
    last = _LAST[0] if _LAST else None  # read once: another thread may replace it
    if last is not None and last.of(caches):
        return last.groups
    by_signature: dict[tuple, list[int]] = {}
    for layer, cache in enumerate(caches):
        by_signature.setdefault(cache_signature(cache), []).append(layer)
    groups = []
    for layers in by_signature.values():
        first = caches[layers[0]]
        size, (_, heads, _, channels) = first.element_size(), first.shape
        starts = [caches[i].data_ptr() - first.data_ptr() for i in layers]
        if any(s % size for s in starts):
            raise ValueError("KV caches of one layout must be element-aligned with each other")
        block_c = min(triton.next_power_of_2(channels), max(16, CHUNK_BYTES // size))
        groups.append(_Group(tuple(layers), device_table(tuple(s // size for s in starts), first.device), block_c,
                             (len(layers) * heads, triton.cdiv(channels, block_c)), alignment(first, starts, block_c)))
    _LAST[:] = [_Layout(tuple(weakref.ref(c) for c in caches), tuple(c.data_ptr() for c in caches), tuple(groups))]
    return tuple(groups)


def copy_kept(caches: Sequence[torch.Tensor], positions: torch.Tensor, anchor_row: Sequence[int],
              src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move every layer's kept tokens into place, one launch per group of layers sharing a layout.

    Parameters
    ----------
    caches:
        Per layer, the logical ``[num_blocks, H, block_size, 2 * D]`` view (one device, any strides).
    positions:
        ``long [A, H, num_keep]``: kept rows of the region per anchor and head, increasing along the last dim
        (any strides; joint selection's expanded heads included).
    anchor_row:
        Per layer, its anchor's index into ``positions``.
    src_slots, dst_slots:
        ``long [S]`` and ``long [num_keep]``: the region's slots in row order, and where kept row ``i`` goes,
        ``dst_slots == src_slots[:num_keep]`` (the module docstring's in-place rule).
    """
    num_keep = dst_slots.shape[0]
    if num_keep == 0:
        return
    _, heads, block_size, channels = caches[0].shape
    kernel = compiled(interpreting())
    src_slots, dst_slots = src_slots.contiguous(), dst_slots.contiguous()
    for group in _layout(caches):
        first = caches[group.layers[0]]
        rows = device_table(tuple(anchor_row[i] for i in group.layers), first.device)
        launch("copy", kernel, group.grid, first.view(_RAW[first.element_size()]), group.offsets, rows, positions,
               src_slots, dst_slots, num_keep, heads, channels, *first.stride(), *positions.stride(),
               BLOCK_SIZE=block_size, BLOCK_T=TILE_ROWS, BLOCK_C=group.block_c, ALIGN=group.align, num_warps=WARPS)


def alignment(first: torch.Tensor, starts: Sequence[int], block_c: int) -> int:
    """Elements per 16 bytes of ``first``'s dtype where every token's channels of every layer start 16-byte aligned
    (the first layer's address and the others' byte offsets ``starts`` from it, the block, head and token strides,
    contiguous channels, a channel count and chunk of whole 16-byte words); else 1 (one element per access)."""
    size = first.element_size()
    vec = max(1, 16 // size)
    s_block, s_head, s_offset, s_channel = first.stride()
    channels = first.shape[-1]
    aligned = (first.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in starts) and s_channel == 1
               and all(x % vec == 0 for x in (s_block, s_head, s_offset, channels, block_c)))
    return vec if aligned else 1
