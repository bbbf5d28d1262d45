"""The exact-count rule (``select_exact``): every policy keeps exactly ``need`` candidates at every granularity."""

from __future__ import annotations

import pytest
import torch
from kv_cases import policy_inputs

from cords_vllm.selection import available_selectors, get_selector
from cords_vllm.selection.exact import select_exact
from cords_vllm.utils import cdiv

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
    candidates = torch.arange(t)[None, :] >= PROTECTED
    return keys, values, candidates, labels[None, :]


@pytest.mark.parametrize("policy", ["cords", "uniform", "recency", "value_norm", "infinipot_v", "v_only"])
@pytest.mark.parametrize("need", [1, 16, 23, 40, 71, 120, sum(FRAME_SIZES) - 1])
def test_frames_are_whole_but_one_and_the_count_is_exact(policy, need):
    keys, values, cand, frames = _region(need)
    pos = select_exact(get_selector(policy), keys, values, need, candidates=cand, granularity="frame",
                       group_size=16, group_index=frames, frame_tokens=16)
    assert pos.shape == (1, PROTECTED + need)
    kept = pos[0]
    assert kept[:PROTECTED].tolist() == list(range(PROTECTED))  # protected tokens always kept
    label = frames[0]
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
    keys, values, cand, frames = _region(3, sizes=[16] * 8)
    selector = get_selector("cords")
    ref = selector.select(keys, values, 48, candidates=cand, granularity="frame", group_size=16, group_index=frames)
    assert int((ref.keep & cand).sum()) == 48
    pos = select_exact(selector, keys, values, 48, candidates=cand, granularity="frame", group_size=16,
                       group_index=frames)
    assert torch.equal(pos[0], ref.keep[0].nonzero().flatten())


def test_per_head_frames_are_problems_of_one_head():
    keys, values, cand, frames = _region(4)
    pos = select_exact(get_selector("cords"), keys.transpose(0, 1), values.transpose(0, 1), 40,
                       candidates=cand.expand(2, -1), granularity="frame", group_size=16,
                       group_index=frames.expand(2, -1))
    assert pos.shape == (2, PROTECTED + 40)


@pytest.mark.parametrize("policy", ["cords", "uniform", "recency", "infinipot_v"])
@pytest.mark.parametrize("need", [5, 8, 30, 100])
def test_the_frame_cut_by_the_region_edge_is_kept_whole(policy, need):
    # The newest frame holds 7 of its 16 tokens (the rest lies past the block-aligned region edge): it is
    # kept whole, to compete as a whole frame next time, unless the budget is smaller than it.
    sizes = [16, 9, 16, 16, 3, 16, 16, 1, 16, 16, 16, 7]
    keys, values, cand, frames = _region(need, sizes=sizes)
    pos = select_exact(get_selector(policy), keys, values, need, candidates=cand, granularity="frame",
                       group_size=16, group_index=frames, frame_tokens=16)
    assert pos.shape == (1, PROTECTED + need)
    kept = pos[0]
    label = frames[0]
    newest = (label == label[-1]).nonzero().flatten()
    assert bool(torch.isin(newest, kept).all()) == (need > 7)
    partial = sum(0 < int(torch.isin(m, kept).sum()) < m.numel()
                  for m in ((label == x).nonzero().flatten() for x in label[PROTECTED:].unique()))
    assert partial <= 1


@pytest.mark.parametrize("policy", available_selectors())
@pytest.mark.parametrize(("granularity", "labelled"), [("token", False), ("block", False), ("frame", False),
                                                        ("frame", True)])
@pytest.mark.parametrize("need", [0, 1, 15, 16, 33, 100, sum(FRAME_SIZES) - 1])
def test_every_policy_keeps_exactly_need_at_every_granularity(policy, granularity, labelled, need):
    keys, values, cand, frames = _region(need + 7)
    keys, values = torch.cat([keys, keys.flip(2)]), torch.cat([values, -values])  # two problems
    cand, frames = cand.expand(2, -1), frames.expand(2, -1)
    selector = get_selector(policy)
    pos = select_exact(selector, keys, values, need, candidates=cand, granularity=granularity,
                       group_size=16, group_index=frames if labelled else None, frame_tokens=16,
                       num_candidates=sum(FRAME_SIZES), generator=torch.Generator().manual_seed(0),
                       **policy_inputs(selector, keys))
    assert pos.shape == (2, PROTECTED + need)
    assert bool((pos[:, 1:] > pos[:, :-1]).all())  # increasing: a set of positions
    assert pos[:, :PROTECTED].tolist() == [list(range(PROTECTED))] * 2  # protected tokens always kept


@pytest.mark.parametrize("need", [-1, sum(FRAME_SIZES)])
def test_need_outside_the_candidates_is_refused(need):
    keys, values, cand, _ = _region(0)
    with pytest.raises(ValueError, match="need"):
        select_exact(get_selector("cords"), keys, values, need, candidates=cand)


def test_a_host_frame_budget_gives_the_computed_budgets_result():
    keys, values, cand, frames = _region(5)
    selector = get_selector("cords")
    computed = select_exact(selector, keys, values, 40, candidates=cand, granularity="frame", group_size=16,
                            group_index=frames)
    small = sum(0 < n < 16 for n in FRAME_SIZES)
    given = select_exact(selector, keys, values, 40, candidates=cand, granularity="frame", group_size=16,
                         group_index=frames, frame_budget=cdiv(40, 16) + small, num_candidates=sum(FRAME_SIZES))
    assert torch.equal(computed, given)
