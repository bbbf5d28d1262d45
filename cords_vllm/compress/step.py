"""The compress step: read a request's held region, select what to keep, compact it in place (pure torch).

One call carries out one :class:`~cords_vllm.compress.plan.CompressionPlan` on the paged KV cache of every
layer, as a function of tensors only (no vLLM object), so any engine adapter, model family or kernel can
drive it:

1. ``held ++ new_ids``: the logical ids of the region's tokens, per layer and head, in row order (the
   previously kept tokens, then the tokens that entered the region with this compression).
2. Anchor layers read those tokens (:class:`~cords_vllm.compress.kv_access.KVAccessor`), mark video tokens
   as candidates (the rest is protected) and run :func:`~cords_vllm.selection.exact.select_exact`.
3. Every layer copies the tokens at its anchor's positions into the first ``num_keep / block_size`` source
   blocks, in logical order. A layer's sources are read in full before it is written, so kept blocks may
   overlap sources.

Everything lives on the caches' device; the host supplies only the plan's integers (in
:class:`RegionBatch`), so the step itself never reads a tensor back to the host. (The selectors may: their
data-dependent checks and greedy loops synchronise a few times per compression, never in a step without
one.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cords_vllm.compress.kv_access import KVAccessor
from cords_vllm.selection.base import Selector
from cords_vllm.selection.exact import select_exact


@dataclass(frozen=True)
class RegionBatch:
    """What one compression of one request needs, as device tensors plus host integers.

    Attributes
    ----------
    src_slots:
        ``long [S]``: slots of the blocks the region holds now, in row order (``S = num_held``).
    dst_slots:
        ``long [num_keep]``: slots the kept tokens are written to (the first source blocks).
    new_ids:
        ``long [S - n_prev]``: logical ids of the tokens that entered the region with this compression.
    spans:
        ``long [V, 2]``: the request's logical video ``[start, end)`` ranges (candidates).
    frame_labels:
        ``long [L]``, frame granularity only: the frame label (M-RoPE temporal position) of every logical
        token of the request; ``None`` otherwise.
    num_keep, num_keep_candidates, num_candidates:
        Tokens kept in the region (protected included), video tokens kept, video tokens held.
    group_size:
        Tokens per selection group (the largest frame, or the block size); ``None`` at token granularity.
    frame_budget:
        Frames to ask the selector for at frame granularity (``None``: the fewest that always hold enough,
        see :func:`~cords_vllm.selection.exact.select_exact`).
    frame_tokens:
        Tokens per frame for frame-aware policies at token granularity, or ``None``.
    """

    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    new_ids: torch.Tensor
    spans: torch.Tensor
    frame_labels: torch.Tensor | None
    num_keep: int
    num_keep_candidates: int
    num_candidates: int
    group_size: int | None = None
    frame_budget: int | None = None
    frame_tokens: int | None = None


@dataclass(frozen=True)
class SelectionSetup:
    """How a model's layers select: the policy, its unit, per-head or joint, and each layer's anchor."""

    selector: Selector
    granularity: str
    per_head: bool
    anchor_of: tuple[int, ...]

    @property
    def anchors(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.anchor_of)))


def video_mask(logical_ids: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """``bool``, shape of ``logical_ids``: True where the id lies in one of ``spans`` (``long [V, 2]``)."""
    ids = logical_ids[..., None]
    return ((ids >= spans[:, 0]) & (ids < spans[:, 1])).any(-1)


def region_ids(held: torch.Tensor | None, new_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``long [H, n_prev + n_new]``: the logical ids a layer's region holds, in row order."""
    new = new_ids.expand(num_heads, -1)
    return new if held is None else torch.cat([held, new], dim=1)


def select_positions(setup: SelectionSetup, keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                     batch: RegionBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """Kept positions into the held tokens of each anchor layer and head.

    ``keys``/``values``: ``[A, H, T, D]`` of the ``A`` anchors; ``ids``: ``long [A, H, T]`` their logical ids.
    Returns ``long [A, H, num_keep]``, increasing along the last dim.
    """
    a, h, t, d = keys.shape
    candidates = video_mask(ids, batch.spans)  # [A, H, T]
    labels = None if batch.frame_labels is None else batch.frame_labels[ids]  # [A, H, T]
    if setup.per_head:
        k, v, cand = keys.reshape(a * h, 1, t, d), values.reshape(a * h, 1, t, d), candidates.reshape(a * h, t)
        labels = None if labels is None else labels.reshape(a * h, t)
    else:  # joint selection: every head of a layer holds the same tokens
        k, v, cand = keys, values, candidates[:, 0]
        labels = None if labels is None else labels[:, 0]
    positions = select_exact(
        setup.selector, k, v, batch.num_keep_candidates, candidates=cand, granularity=setup.granularity,
        group_size=batch.group_size, group_index=labels if setup.granularity == "frame" else None,
        num_candidates=batch.num_candidates, frame_budget=batch.frame_budget, frame_tokens=batch.frame_tokens,
        generator=generator)
    return positions.reshape(a, h, -1) if setup.per_head else positions[:, None, :].expand(a, h, -1)


@torch.inference_mode()
def compress_region(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor],
                    held: Sequence[torch.Tensor | None], batch: RegionBatch, setup: SelectionSetup,
                    generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Compact one request's region in every layer; returns each layer's new held ids.

    Parameters
    ----------
    caches, accessors:
        One KV cache tensor and its accessor per layer (all on one device).
    held:
        Per layer, ``long [H, n_prev]`` logical ids the region held after the previous compression (on the
        caches' device), or ``None`` before the first one.
    batch, setup:
        This compression (:class:`RegionBatch`) and the model's selection setup.

    Returns
    -------
    list[torch.Tensor]
        Per layer, ``long [H, num_keep]``: the logical ids now held in the region, in row order.
    """
    heads = accessors[0].num_kv_heads
    ids = [region_ids(h, batch.new_ids, heads) for h in held]
    anchors = setup.anchors
    read = {a: accessors[a].read(caches[a], batch.src_slots) for a in anchors}  # [T, H, D] each
    keys = torch.stack([read[a][0].transpose(0, 1) for a in anchors])
    values = torch.stack([read[a][1].transpose(0, 1) for a in anchors])
    positions = select_positions(setup, keys, values, torch.stack([ids[a] for a in anchors]), batch, generator)
    row_of = {a: i for i, a in enumerate(anchors)}
    head_index = torch.arange(heads, device=positions.device)[None, :]
    new_held = []
    for layer, accessor in enumerate(accessors):
        pos = positions[row_of[setup.anchor_of[layer]]]  # [H, num_keep]
        k, v = read[layer] if layer in read else accessor.read(caches[layer], batch.src_slots)
        accessor.write(caches[layer], batch.dst_slots, k[pos.T, head_index], v[pos.T, head_index])
        new_held.append(torch.gather(ids[layer], 1, pos))
    return new_held
