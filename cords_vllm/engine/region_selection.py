"""Which held tokens of a compressed region each anchor layer keeps (pure torch, no vLLM).

The engine needs an exact count: every layer (and every head) must keep ``protected + num_keep_video``
tokens so that they fill whole KV blocks. Selectors guarantee exact counts at token granularity; at
frame/block granularity they keep whole groups, so the region selection asks for ``ceil(n / g)`` groups and
trims the last group the policy chose to the tokens still needed (its oldest ones). Group granularity falls
back to token granularity when the held candidates do not contain enough whole groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cords_vllm.selection import Selector


def video_mask(logical_ids: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``bool`` mask, same shape as ``logical_ids``: True where the id lies in a video span."""
    mask = torch.zeros_like(logical_ids, dtype=torch.bool)
    for start, end in spans:
        mask |= (logical_ids >= start) & (logical_ids < end)
    return mask


def select_region(selector: Selector, keys: torch.Tensor, values: torch.Tensor, held_ids: torch.Tensor,
                  spans: Sequence[tuple[int, int]], num_keep_video: int, *, granularity: str = "token",
                  group_size: int | None = None, per_head: bool = False, frame_tokens: int | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Kept positions (indices into the held tokens) for each anchor layer and head.

    Parameters
    ----------
    keys, values:
        ``[A, H, T, D]``: the held tokens of ``A`` anchor layers.
    held_ids:
        ``long [A, H, T]``: logical id of each held token (identical across heads unless a previous
        compression selected per head).
    spans:
        Logical video spans; held tokens outside them are protected (always kept).
    num_keep_video:
        Video tokens to keep per layer (per head when ``per_head``); fewer than the held video tokens.
    granularity, group_size:
        Selection unit; ``group_size`` is required for ``"frame"`` / ``"block"``.
    per_head:
        Each head selects its own tokens; otherwise the heads of a layer select jointly.
    frame_tokens:
        Tokens per frame, passed to frame-aware policies at token granularity (``infinipot_v``).

    Returns
    -------
    torch.Tensor
        ``long [A, H, n_keep]`` sorted positions, ``n_keep = protected + num_keep_video``.
    """
    a, h, t, d = keys.shape
    candidates = video_mask(held_ids, spans)  # [A, H, T]
    if per_head:
        k, v, cand = keys.reshape(a * h, 1, t, d), values.reshape(a * h, 1, t, d), candidates.reshape(a * h, t)
    else:
        if not bool((held_ids == held_ids[:, :1]).all()):
            raise ValueError("joint selection needs the same held tokens in every head (per_head was used "
                             "before?)")
        k, v, cand = keys, values, candidates[:, 0]
    n_cand = cand.sum(-1)
    if int(n_cand.min()) <= num_keep_video:
        raise ValueError(f"num_keep_video={num_keep_video} must be < held video tokens ({int(n_cand.min())})")

    g = group_size if granularity != "token" else None
    if g is not None and -(-num_keep_video // g) > int(n_cand.min()) // g:
        g, granularity = None, "token"  # not enough whole groups: select tokens
    if g is None:
        result = selector.select(k, v, num_keep_video, candidates=cand, granularity="token",
                                 group_size=frame_tokens, generator=generator)
        keep = result.keep
    else:
        n_groups = -(-num_keep_video // g)
        result = selector.select(k, v, n_groups * g, candidates=cand, granularity=granularity, group_size=g,
                                 generator=generator)
        keep = result.keep.clone()
        excess = n_groups * g - num_keep_video
        if excess:
            last = result.order[:, n_groups - 1]  # [B] the group chosen last
            rank = torch.cumsum(cand.to(torch.long), dim=-1) - 1
            first_dropped = last[:, None] * g + (g - excess)
            keep &= ~(cand & (rank >= first_dropped) & (rank < last[:, None] * g + g))
    positions = result_positions(keep)
    return positions.reshape(a, h, -1) if per_head else positions[:, None, :].expand(a, h, -1).contiguous()


def result_positions(keep: torch.Tensor) -> torch.Tensor:
    """Sorted indices of True entries of ``bool [B, T]``, ``long [B, n]``; every row must keep ``n``."""
    counts = keep.sum(-1)
    n = int(counts.max())
    if int(counts.min()) != n:
        raise AssertionError(f"selection kept unequal counts {counts.tolist()}")
    return torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :n]
