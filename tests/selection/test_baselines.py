"""Each baseline does what its docstring says (checked against small loop-based references)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_cases import random_candidates, random_kv

from cords_vllm.selection import get_selector

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cand_list(cand: torch.Tensor) -> list[int]:
    return [i for i, c in enumerate(cand.tolist()) if c]


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), data=st.data())
def test_uniform_takes_the_centre_of_equal_slices(seed: int, n: int, data: st.DataObject) -> None:
    keys, values = random_kv(seed, 1, 1, n, 2)
    cand = random_candidates(seed, 1, n, 0.7)
    c = cand_list(cand[0])
    b = data.draw(st.integers(0, max(0, len(c) - 1))) if c else 0
    res = get_selector("uniform").select(keys, values, b, candidates=cand)
    want = [c[((2 * t + 1) * len(c)) // (2 * b)] for t in range(b)] if b < len(c) else []
    assert [int(x) for x in res.order[0] if x >= 0] == want


@pytest.mark.parametrize("sinks", [0, 1, 4])
def test_recency_keeps_sinks_and_the_latest(sinks: int) -> None:
    keys, values = random_kv(0, 2, 2, 30, 3)
    cand = random_candidates(0, 2, 30, 0.8)
    for b in range(0, 12):
        res = get_selector("recency", sinks=sinks).select(keys, values, b, candidates=cand)
        for row in range(2):
            c = cand_list(cand[row])
            s = min(sinks, b)
            want = set(c[:s]) | set(c[len(c) - (b - s):]) if b < len(c) else set(c)
            kept = {i for i in c if bool(res.keep[row, i])}
            assert kept == want


def test_recency_at_frame_granularity_keeps_the_last_frames() -> None:
    keys, values = random_kv(1, 1, 1, 40, 2)
    res = get_selector("recency", sinks=1).select(keys, values, 12, granularity="frame", group_size=4)
    assert res.keep[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 32, 33, 34, 35, 36, 37, 38, 39]


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), per_head=st.booleans(), data=st.data())
def test_value_norm_is_top_k_by_value_norm(seed: int, n: int, per_head: bool, data: st.DataObject) -> None:
    keys, values = random_kv(seed, 1, 2, n, 3)
    b = data.draw(st.integers(0, n))
    res = get_selector("value_norm").select(keys, values, b, per_head=per_head)
    if per_head:
        norms = torch.linalg.vector_norm(values[0], dim=-1)  # [H, N]
        for h in range(2):
            want = set(torch.topk(norms[h], min(b, n)).indices.tolist())
            assert set(res.keep[0, h].nonzero().flatten().tolist()) == want
    else:
        norms = torch.linalg.vector_norm(values[0].permute(1, 0, 2).reshape(n, -1), dim=-1)
        want = set(torch.topk(norms, min(b, n)).indices.tolist())
        assert set(res.keep[0].nonzero().flatten().tolist()) == want


def test_value_norm_ties_go_to_the_lowest_index() -> None:
    values = torch.ones(1, 1, 10, 2)
    keys = torch.zeros(1, 1, 10, 2)
    res = get_selector("value_norm").select(keys, values, 3)
    assert res.order[0].tolist() == [0, 1, 2]


def test_random_is_seeded_and_uniform_enough() -> None:
    keys, values = random_kv(0, 1, 1, 100, 2)
    a = get_selector("random", seed=3).select(keys, values, 10)
    b = get_selector("random", seed=3).select(keys, values, 10)
    c = get_selector("random", seed=4).select(keys, values, 10)
    assert torch.equal(a.keep, b.keep) and not torch.equal(a.keep, c.keep)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    d = get_selector("random").select(keys, values, 10, generator=g1)
    e = get_selector("random").select(keys, values, 10, generator=g2)
    assert torch.equal(d.keep, e.keep)
    # Each token is kept with frequency close to b / n over many seeds.
    freq = torch.zeros(100)
    for s in range(200):
        freq += get_selector("random", seed=s).select(keys, values, 10).keep[0].float()
    assert float(freq.min()) >= 3 and float(freq.max()) <= 45


def infinipot_reference(keys: torch.Tensor, values: torch.Tensor, cand: list[int], b: int, frame: int,
                        tar_ratio: float) -> list[int]:
    """Loop-based InfiniPot-V over one problem's joint features ``[N, F]``."""
    n = len(cand)
    red = []
    for r in range(n):
        partner = r + frame if r + frame < n else (r - frame if r - frame >= 0 else None)
        if partner is None:
            red.append(0.0)
            continue
        x, y = keys[cand[r]], keys[cand[partner]]
        red.append(float(x @ y) / (float(x.norm()) * float(y.norm())))
    n_tar = math.floor(b * tar_ratio)
    tar = sorted(range(n), key=lambda r: (red[r], r))[:n_tar]
    rest = [r for r in range(n) if r not in tar]
    van = sorted(rest, key=lambda r: (-float(values[cand[r]].norm()), r))[: b - n_tar]
    return [cand[r] for r in tar + van]


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), frame=st.integers(1, 8),
       tar_ratio=st.sampled_from([0.0, 0.3, 0.5, 1.0]), data=st.data())
def test_infinipot_v_matches_reference(seed: int, n: int, frame: int, tar_ratio: float,
                                       data: st.DataObject) -> None:
    keys, values = random_kv(seed, 1, 2, n, 3)
    cand = random_candidates(seed, 1, n, 0.8)
    c = cand_list(cand[0])
    b = data.draw(st.integers(0, len(c)))
    res = get_selector("infinipot_v", tar_ratio=tar_ratio).select(keys, values, b, candidates=cand,
                                                                   group_size=frame)
    kj = keys[0].permute(1, 0, 2).reshape(n, -1)
    vj = values[0].permute(1, 0, 2).reshape(n, -1)
    want = infinipot_reference(kj, vj, c, b, frame, tar_ratio) if b < len(c) else []
    assert [int(x) for x in res.order[0] if x >= 0] == want


def test_infinipot_v_drops_static_tokens_first() -> None:
    # 6 frames of 4 tokens: frames 0-2 identical (static), frames 3-5 change every frame.
    keys, values = random_kv(2, 1, 1, 24, 8)
    keys[:, :, 4:12] = keys[:, :, 0:4].repeat(1, 1, 2, 1)
    values = torch.ones_like(values)  # value norms tie: VaN falls back to the lowest index
    res = get_selector("infinipot_v", tar_ratio=1.0).select(keys, values, 8, group_size=4)
    kept = set(res.keep[0].nonzero().flatten().tolist())
    assert kept.isdisjoint(range(0, 8))  # redundant with the next frame


def test_infinipot_v_needs_the_frame_length_at_token_granularity() -> None:
    keys, values = random_kv(0, 1, 1, 16, 2)
    for budget in (4, 100):  # checked up front, even when the budget covers everything
        with pytest.raises(ValueError, match="group_size: infinipot_v needs group_size"):
            get_selector("infinipot_v").select(keys, values, budget)
