"""Groups of consecutive candidates: centroids, partial groups, expansion, kept indices."""

from __future__ import annotations

import pytest
import torch
from kv_cases import random_candidates, random_kv

from cords_vllm.selection import SelectionResult, get_selector, kept_candidate_count
from cords_vllm.selection.features import group_features, token_features
from cords_vllm.selection.granularity import candidate_ranks, group_centroids, group_ids
from cords_vllm.utils import cdiv


def test_centroids_match_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 17, 5, generator=g, dtype=torch.float64)
    cand = random_candidates(1, 3, 17, 0.7)
    rank, count = candidate_ranks(cand)
    gid = group_ids(rank, 3)
    n_groups = cdiv(int(count.max()), 3)
    cent = group_centroids(feats, gid, n_groups)
    for p in range(3):
        idx = [i for i in range(17) if cand[p, i]]
        assert int(count[p]) == len(idx)
        for gi in range(n_groups):
            members = idx[gi * 3:(gi + 1) * 3]
            want = feats[p, members].mean(0) if members else torch.zeros(5, dtype=torch.float64)
            assert torch.allclose(cent[p, gi], want)


def test_group_selection_keeps_whole_groups_and_skips_the_partial_one() -> None:
    keys, values = random_kv(2, 1, 2, 23, 3)
    cand = torch.ones(1, 23, dtype=torch.bool)
    cand[0, :2] = False  # 21 candidates = 5 full groups of 4 + a partial group of 1
    for name in ("cords", "uniform", "recency", "value_norm", "infinipot_v", "random"):
        for budget in range(0, 21):
            res = get_selector(name).select(keys, values, budget, candidates=cand, granularity="block",
                                            group_size=4)
            kept_cand = res.keep[0] & cand[0]
            assert int(kept_cand.sum()) == kept_candidate_count(21, budget, "block", 4)
            assert not bool(kept_cand[22])  # the partial group (token 22) is never chosen
            groups = (torch.arange(23) - 2).clamp_min(0) // 4
            for gi in range(5):
                members = kept_cand[(groups == gi) & cand[0]]
                assert bool(members.all()) or not bool(members.any())
        res = get_selector(name).select(keys, values, 21, candidates=cand, granularity="block", group_size=4)
        assert bool(res.keep.all())


def test_frames_follow_candidate_order_across_protected_tokens() -> None:
    # Protected tokens in the middle of a frame do not break it: groups are runs of candidates.
    keys, values = random_kv(3, 1, 1, 10, 2)
    cand = torch.tensor([[True, True, False, True, True, True, False, False, True, True]])
    res = get_selector("recency").select(keys, values, 3, candidates=cand, granularity="frame", group_size=3)
    # Candidates: 0 1 3 | 4 5 8 | 9 -> keep the most recent full group (4, 5, 8) + protected 2, 6, 7.
    assert res.keep[0].nonzero().flatten().tolist() == [2, 4, 5, 6, 7, 8]
    assert res.order[0].tolist() == [1]


def test_kept_indices_requires_rectangular_results() -> None:
    keep = torch.tensor([[True, False, True], [False, True, False]])
    res = SelectionResult(keep=keep, order=torch.zeros(2, 0, dtype=torch.long), granularity="token",
                          group_size=None, per_head=False)
    try:
        res.kept_indices()
    except ValueError as exc:
        assert "not rectangular" in str(exc)
    else:
        raise AssertionError("expected ValueError")
    keys, values = random_kv(4, 2, 3, 20, 2)
    out = get_selector("cords").select(keys, values, 5, per_head=True)
    idx = out.kept_indices()
    assert idx.shape == (2, 3, 5)
    assert torch.equal(torch.zeros_like(out.keep).scatter_(-1, idx, True), out.keep)


def test_shared_candidate_fast_paths_match_the_general_path() -> None:
    keys, values = random_kv(5, 2, 3, 30, 4)
    contiguous = torch.zeros(2, 30, dtype=torch.bool)
    contiguous[:, 3:26] = True
    scattered = random_candidates(5, 1, 30, 0.7).expand(2, 30).clone()
    for cand in (torch.ones(2, 30, dtype=torch.bool), contiguous, scattered):
        for per_head in (False, True):
            rank, count = candidate_ranks(cand if not per_head else cand.repeat_interleave(3, 0))
            n_groups = cdiv(int(count.max()), 4)
            n_full = int(count.min()) // 4
            fast = group_features(keys, values, cand, 4, n_groups, per_head, torch.float64)
            feats = token_features(keys, values, per_head, torch.float64)
            slow = group_centroids(feats, group_ids(rank, 4), n_groups)
            assert fast.shape[0] == slow.shape[0] and fast.shape[2] == slow.shape[2]
            assert torch.allclose(fast[:, :n_full], slow[:, :n_full], atol=1e-12)


def _labelled_reference(name, keys, values, cand, labels, budget, group_size):
    """Frame selection with labelled groups, by hand: centroids of each label's candidates, selected as tokens."""
    b = keys.shape[0]
    keep = ~cand.clone()
    for p in range(b):
        members = {}
        for i in range(keys.shape[2]):
            if cand[p, i]:
                members.setdefault(int(labels[p, i]), []).append(i)
        groups = [members[k] for k in sorted(members)]
        ck = torch.stack([keys[p, :, idx].mean(1) for idx in groups], dim=1)[None]  # [1, H, G, D]
        cv = torch.stack([values[p, :, idx].mean(1) for idx in groups], dim=1)[None]
        if cand[p].sum() <= budget:
            keep[p] |= cand[p]
            continue
        sel = get_selector(name)
        frame_aware = {"group_size": 1} if sel.needs_frame_length else {}
        res = sel.select(ck, cv, budget // group_size, **frame_aware)
        for gi in res.keep[0].nonzero().flatten().tolist():
            keep[p, groups[gi]] = True
    return keep


def test_labelled_groups_equal_selecting_their_centroids_as_tokens() -> None:
    # Frames cut by earlier evictions (sizes 1..4) and protected tokens in between, several problems.
    g = torch.Generator().manual_seed(5)
    n, size = 40, 4
    for trial in range(6):
        keys, values = random_kv(10 + trial, 3, 2, n, 4)
        keys, values = keys.double(), values.double()
        cand = random_candidates(20 + trial, 3, n, 0.8)
        # random frame cuts, and no frame longer than `size` candidates: both terms are non-decreasing
        cuts = torch.cumsum(torch.rand(3, n, generator=g) < 0.35, dim=-1)
        labels = cuts * 100 + torch.cumsum(cand.long(), -1) // size
        for name in ("cords", "uniform", "recency", "value_norm", "infinipot_v", "k_only", "v_only"):
            for budget in (4, 9, 16):
                res = get_selector(name).select(keys, values, budget, candidates=cand, granularity="frame",
                                                group_size=size, group_index=labels)
                want = _labelled_reference(name, keys, values, cand, labels, budget, size)
                assert torch.equal(res.keep, want), (name, budget, trial)


def test_labelled_groups_of_full_size_equal_fixed_runs() -> None:
    keys, values = random_kv(7, 2, 2, 32, 4)
    cand = torch.ones(2, 32, dtype=torch.bool)
    cand[:, :4] = False
    labels = (torch.arange(32) - 4).clamp_min(0).div(4, rounding_mode="floor").expand(2, 32).contiguous()
    for name in ("cords", "uniform", "infinipot_v"):
        a = get_selector(name).select(keys, values, 12, candidates=cand, granularity="frame", group_size=4)
        b = get_selector(name).select(keys, values, 12, candidates=cand, granularity="frame", group_size=4,
                                      group_index=labels)
        assert torch.equal(a.keep, b.keep) and torch.equal(a.order, b.order)


def test_group_index_is_validated() -> None:
    keys, values = random_kv(1, 1, 1, 8, 2)
    sel = get_selector("cords")
    with pytest.raises(ValueError, match="non-decreasing"):
        sel.select(keys, values, 2, granularity="frame", group_size=2,
                   group_index=torch.tensor([[0, 0, 1, 1, 0, 2, 3, 3]]))
    with pytest.raises(ValueError, match="more than group_size"):
        sel.select(keys, values, 2, granularity="frame", group_size=2,
                   group_index=torch.tensor([[0, 0, 0, 1, 2, 2, 3, 3]]))
    with pytest.raises(ValueError, match="frame/block granularity"):
        sel.select(keys, values, 2, group_index=torch.zeros(1, 8, dtype=torch.long))
