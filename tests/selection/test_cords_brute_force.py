"""The fast CoRDS implementation picks exactly what a literal transcription of Algorithm 1 picks.

Equality is checked in float64 (float64 inputs are computed in float64), where rounding cannot flip a
comparison on continuous random data; float32 is checked against it for agreement.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from brute_force import brute_force_select, order_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_cases import Case, cases, random_candidates, random_kv

from cords_vllm.selection import get_selector

SHAPES = [  # (B, H, N, D, budget, group_size, candidate probability)
    (1, 1, 1, 1, 0, 1, 1.0),
    (1, 1, 7, 3, 3, 2, 1.0),
    (2, 2, 19, 2, 7, 3, 0.8),
    (1, 3, 24, 4, 10, 4, 0.6),
    (3, 1, 16, 1, 9, 2, 0.9),  # D = 1: the span saturates after one pick
    (1, 2, 30, 3, 20, 5, 1.0),  # budget > feature dim: exact residuals reach zero
]


def _compare(case: Case, **params) -> None:
    res = get_selector("cords", **params).select(case.keys, case.values, case.budget, **case.kwargs())
    keep, orders = brute_force_select(case.keys, case.values, case.budget, **case.kwargs(), **params)
    assert order_rows(res.order) == orders
    assert torch.equal(res.keep, keep)


@pytest.mark.parametrize("granularity", ["token", "frame", "block"])
@pytest.mark.parametrize("novelty", ["exact", "max_cosine"])
@pytest.mark.parametrize("per_head", [False, True])
def test_matches_brute_force_on_many_shapes(granularity: str, novelty: str, per_head: bool) -> None:
    for i, (b, h, n, d, budget, g, p) in enumerate(SHAPES):
        keys, values = random_kv(100 + i, b, h, n, d)
        cand = random_candidates(100 + i, b, n, p)
        case = Case(keys, values, cand, budget, granularity, g, per_head)
        _compare(case, novelty=novelty)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_n=16, max_d=4),
       alpha=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
       eta=st.sampled_from([0.0, 0.25, 1.0]),
       lam=st.sampled_from([0.0, 0.25, 1.0, 3.0]),
       eps0=st.sampled_from([1e-6, 1e-2]),
       novelty=st.sampled_from(["exact", "max_cosine"]))
def test_matches_brute_force_for_any_hyperparameters(case: Case, alpha: float, eta: float, lam: float,
                                                      eps0: float, novelty: str) -> None:
    _compare(case, alpha=alpha, eta=eta, lam=lam, eps0=eps0, novelty=novelty)


@pytest.mark.parametrize("novelty", ["exact", "max_cosine"])
def test_exact_duplicates_tie_to_the_lowest_index(novelty: str) -> None:
    """Duplicated tokens/frames (bf16 caches, static video) tie exactly; both pick the lowest index."""
    keys, values = random_kv(7, 1, 2, 6, 3)
    src = torch.tensor([0, 1, 0, 2, 1, 0, 3, 4, 5, 2, 3, 0])
    keys, values = keys[:, :, src], values[:, :, src]  # 12 tokens, 6 distinct
    for budget in (3, 6, 9, 11):
        _compare(Case(keys, values, None, budget, "token", None, False), novelty=novelty)
        res = get_selector("cords", novelty=novelty).select(keys, values, budget)
        kept = set(src[res.keep[0]].tolist())
        assert len(kept) == min(budget, 6)  # duplicates only once every distinct token is kept
    # Whole frames repeated: frame f of 4 tokens; frames 3 and 5 copy frames 0 and 1.
    k2, v2 = random_kv(8, 1, 2, 24, 3)
    frames = torch.arange(24).view(6, 4)
    for f, s in ((3, 0), (5, 1)):
        k2[:, :, frames[f]] = k2[:, :, frames[s]]
        v2[:, :, frames[f]] = v2[:, :, frames[s]]
    for budget in (8, 16, 20):
        _compare(Case(k2, v2, None, budget, "frame", 4, False), novelty=novelty)


def test_float32_agrees_with_float64() -> None:
    overlap = []
    for seed, (n, d) in itertools.product(range(3), [(200, 8), (400, 16)]):
        keys, values = random_kv(seed, 1, 2, n, d, torch.float64)
        for novelty in ("exact", "max_cosine"):
            sel = get_selector("cords", novelty=novelty)
            a = sel.select(keys, values, n // 8).keep
            b = sel.select(keys.float(), values.float(), n // 8).keep
            overlap.append(float((a & b).sum()) / float(a.sum()))
    assert min(overlap) >= 0.9, overlap


@pytest.mark.parametrize("granularity", ["token", "frame", "block"])
@pytest.mark.parametrize("novelty", ["exact", "max_cosine"])
@pytest.mark.parametrize("alpha", [0.05, 0.25, 1.0])
def test_the_normalized_space_matches_brute_force(granularity: str, novelty: str, alpha: float) -> None:
    for i, (b, h, n, d, budget, g, p) in enumerate(SHAPES):
        keys, values = random_kv(300 + i, b, h, n, d)
        cand = random_candidates(300 + i, b, n, p)
        case = Case(30.0 * keys, values, cand, budget, granularity, g, per_head=i % 2 == 1)
        _compare(case, novelty=novelty, alpha=alpha, space="normalized")


def test_in_the_normalized_space_alpha_weighs_the_spaces_not_their_units() -> None:
    """Scaling every key (or value) by a constant changes nothing there; in the paper's space it moves the
    selection (the negative control), since the distance is then mostly the larger space."""
    moved = 0
    for seed in range(6):
        keys, values = random_kv(400 + seed, 1, 2, 40, 4)
        case = Case(keys, values, random_candidates(400 + seed, 1, 40, 1.0), 12, "token", 1, False)
        for space in ("normalized", "paper"):
            base = get_selector("cords", space=space).select(keys, values, 12, **case.kwargs()).order
            scaled = get_selector("cords", space=space).select(50.0 * keys, 0.1 * values, 12, **case.kwargs()).order
            if space == "normalized":
                assert torch.equal(base, scaled)
            else:
                moved += not torch.equal(base, scaled)
    assert moved >= 3
