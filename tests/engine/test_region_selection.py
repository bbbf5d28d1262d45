"""Exact-count region selection over real frames (pure torch; the engine's worker calls it)."""

from __future__ import annotations

import pytest
import torch

from cords_vllm.engine.region_selection import select_region
from cords_vllm.selection import get_selector

#: Frames as earlier compressions leave them: mostly whole (16 tokens), some cut by trims or the region edge.
FRAME_SIZES = [16, 9, 16, 16, 3, 16, 16, 1, 16, 16, 7, 16]
PROTECTED = 5


def _region(seed: int, heads: int = 2, dim: int = 8, sizes: list[int] = FRAME_SIZES):
    g = torch.Generator().manual_seed(seed)
    labels = torch.cat([torch.full((PROTECTED,), -1)] +
                       [torch.full((n,), 10 + 3 * f) for f, n in enumerate(sizes)])  # M-RoPE-like t
    t = labels.numel()
    keys = torch.randn(1, heads, t, dim, generator=g)
    values = torch.randn(1, heads, t, dim, generator=g)
    held_ids = torch.arange(t).expand(1, heads, t).contiguous()
    spans = [(PROTECTED, t)]
    return keys, values, held_ids, spans, labels.expand(1, heads, t).contiguous()


@pytest.mark.parametrize("policy", ["cords", "uniform", "recency", "value_norm", "infinipot_v", "v_only"])
@pytest.mark.parametrize("need", [1, 16, 23, 40, 71, 120, sum(FRAME_SIZES) - 1])
def test_frames_are_whole_but_one_and_the_count_is_exact(policy, need):
    keys, values, held_ids, spans, frames = _region(need)
    pos = select_region(get_selector(policy), keys, values, held_ids, spans, need, granularity="frame",
                        group_size=16, frame_index=frames, frame_tokens=16)
    assert pos.shape == (1, 2, PROTECTED + need)
    kept = pos[0, 0]
    assert torch.equal(pos[0, 1], kept)
    assert kept[:PROTECTED].tolist() == list(range(PROTECTED))  # protected tokens always kept
    label = frames[0, 0]
    partial = 0
    for value in label[PROTECTED:].unique():
        members = (label == value).nonzero().flatten()
        n_kept = int(torch.isin(members, kept).sum())
        if 0 < n_kept < members.numel():
            partial += 1
            assert torch.isin(members[:n_kept], kept).all()  # a trimmed frame keeps its oldest tokens
    assert partial <= 1


def test_frames_follow_the_policy_choice():
    # Whole frames and a budget of whole frames: the kept frames are exactly the policy's, untrimmed.
    keys, values, held_ids, spans, frames = _region(3, sizes=[16] * 8)
    selector = get_selector("cords")
    cand = torch.zeros(1, held_ids.shape[-1], dtype=torch.bool)
    cand[0, PROTECTED:] = True
    ref = selector.select(keys, values, 48, candidates=cand, granularity="frame", group_size=16,
                          group_index=frames[:, 0])
    assert int((ref.keep & cand).sum()) == 48
    pos = select_region(selector, keys, values, held_ids, spans, 48, granularity="frame", group_size=16,
                        frame_index=frames)
    assert torch.equal(pos[0, 0], ref.keep[0].nonzero().flatten())


def test_per_head_frames():
    keys, values, held_ids, spans, frames = _region(4)
    pos = select_region(get_selector("cords"), keys, values, held_ids, spans, 40, granularity="frame",
                        group_size=16, frame_index=frames, per_head=True)
    assert pos.shape == (1, 2, PROTECTED + 40)


@pytest.mark.parametrize("policy", ["cords", "uniform", "recency", "infinipot_v"])
@pytest.mark.parametrize("need", [5, 8, 30, 100])
def test_the_frame_cut_by_the_region_edge_is_kept_whole(policy, need):
    # The newest frame holds 7 of its 16 tokens (the rest lies past the block-aligned region edge): it is
    # kept whole, to compete as a whole frame next time, unless the budget is smaller than it.
    sizes = [16, 9, 16, 16, 3, 16, 16, 1, 16, 16, 16, 7]
    keys, values, held_ids, spans, frames = _region(need, sizes=sizes)
    pos = select_region(get_selector(policy), keys, values, held_ids, spans, need, granularity="frame",
                        group_size=16, frame_index=frames)
    assert pos.shape == (1, 2, PROTECTED + need)
    kept = pos[0, 0]
    label = frames[0, 0]
    newest = (label == label[-1]).nonzero().flatten()
    assert bool(torch.isin(newest, kept).all()) == (need > 7)
    partial = sum(0 < int(torch.isin(m, kept).sum()) < m.numel()
                  for m in ((label == x).nonzero().flatten() for x in label[PROTECTED:].unique()))
    assert partial <= 1
