"""Which held tokens of a compressed region each anchor layer keeps (pure torch, no vLLM).

The engine needs an exact count: every layer (and every head) must keep ``protected + num_keep_video``
tokens so that they fill whole KV blocks. Selectors guarantee exact counts at token granularity; at
frame/block granularity they keep whole groups, so the region selection asks for enough groups and trims
the groups the policy chose last to the tokens still needed (their oldest ones).

Frames are the video's real frames when the caller passes each held token's frame label (the engine uses
the token's M-RoPE temporal position): a frame cut by an earlier trim or by the region's edge stays one,
smaller, group, so groups never straddle two frames however many times a request was compressed. Without
labels (and at block granularity), groups are fixed runs of ``group_size`` held candidates, and group
granularity falls back to token granularity when the held candidates do not contain enough whole groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cords_vllm.selection import Selector
from cords_vllm.selection.granularity import labelled_group_ids


def video_mask(logical_ids: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``bool`` mask, same shape as ``logical_ids``: True where the id lies in a video span."""
    mask = torch.zeros_like(logical_ids, dtype=torch.bool)
    for start, end in spans:
        mask |= (logical_ids >= start) & (logical_ids < end)
    return mask


def select_region(selector: Selector, keys: torch.Tensor, values: torch.Tensor, held_ids: torch.Tensor,
                  spans: Sequence[tuple[int, int]], num_keep_video: int, *, granularity: str = "token",
                  group_size: int | None = None, per_head: bool = False, frame_tokens: int | None = None,
                  frame_index: torch.Tensor | None = None, generator: torch.Generator | None = None
                  ) -> torch.Tensor:
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
    frame_index:
        ``long [A, H, T]``, optional: the frame label of every held token, non-decreasing along the video
        tokens (values elsewhere ignored). At ``"frame"`` granularity, groups are then the real frames
        (at most ``group_size`` tokens each).

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

    if granularity == "frame" and frame_index is not None:
        assert group_size is not None
        labels = frame_index.reshape(a * h, t) if per_head else frame_index[:, 0]
        keep = _select_labelled_frames(selector, k, v, cand, labels, num_keep_video, group_size, generator)
        positions = result_positions(keep)
        return positions.reshape(a, h, -1) if per_head else positions[:, None, :].expand(a, h, -1).contiguous()

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


def _select_labelled_frames(selector: Selector, k: torch.Tensor, v: torch.Tensor, cand: torch.Tensor,
                            labels: torch.Tensor, need: int, group_size: int,
                            generator: torch.Generator | None) -> torch.Tensor:
    """``bool [B, T]``: protected tokens plus exactly ``need`` candidates, from whole frames the policy chose.

    The newest frame of the region usually continues past the region's edge (the edge is block-aligned):
    when it holds fewer than ``group_size`` tokens it is kept whole this time, so it is complete, and
    competes as a whole frame, at the next compression. Other frames may be smaller than ``group_size``
    too (trimmed before), so ``ceil(n / group_size)`` frames can hold fewer than ``n`` tokens: the budget
    grows by one frame until every problem has enough; then each problem keeps its chosen tokens ordered by
    when the policy chose their frame (oldest token first within a frame), up to its count. Only the
    frames chosen last are trimmed.
    """
    low = torch.iinfo(torch.long).min
    newest = torch.where(cand, labels, low).max(dim=-1, keepdim=True).values  # [B, 1]
    edge = cand & (labels == newest)
    n_edge = edge.sum(-1, keepdim=True)
    edge &= (n_edge < group_size) & (n_edge < need)
    rest = cand & ~edge
    still = need - edge.sum(-1)  # [B] candidates to choose besides the edge frame
    budget = -(-int(still.max()) // group_size) * group_size
    while True:
        result = selector.select(k, v, budget, candidates=rest, granularity="frame", group_size=group_size,
                                 group_index=labels, generator=generator)
        chosen = result.keep & rest
        if bool((chosen.sum(-1) >= still).all()):
            break
        budget += group_size  # terminates: a budget >= the candidates keeps them all (> still)
    b, t = cand.shape
    gid = labelled_group_ids(labels, rest, group_size)[0]
    n_groups = int(gid.max()) + 1
    when = torch.full((b, n_groups + 1), n_groups, dtype=torch.long, device=cand.device)  # unchosen: last
    order = result.order
    if order.shape[-1]:
        steps = torch.arange(order.shape[-1], device=cand.device).expand_as(order)
        when.scatter_(1, torch.where(order >= 0, order, n_groups), steps)
    when[:, n_groups] = n_groups
    # every chosen candidate: (when its frame was chosen, token index); keep the first `still`
    token = torch.arange(t, device=cand.device)
    priority = torch.gather(when, 1, torch.where(gid >= 0, gid, n_groups)) * t + token
    priority = torch.where(chosen, priority, torch.iinfo(torch.long).max)
    rank = torch.empty_like(priority).scatter_(1, torch.argsort(priority, dim=-1, stable=True),
                                               token.expand(b, t).contiguous())
    return ~cand | edge | (chosen & (rank < still[:, None]))


def result_positions(keep: torch.Tensor) -> torch.Tensor:
    """Sorted indices of True entries of ``bool [B, T]``, ``long [B, n]``; every row must keep ``n``."""
    counts = keep.sum(-1)
    n = int(counts.max())
    if int(counts.min()) != n:
        raise AssertionError(f"selection kept unequal counts {counts.tolist()}")
    return torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :n]
