"""Properties of CoRDS that follow from its definition (beyond equality with the brute force)."""

from __future__ import annotations

import pytest
import torch
from brute_force import seed_features
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_cases import Case, cases, random_kv

from cords_vllm.selection import get_selector

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def plain_d2(keys: torch.Tensor, values: torch.Tensor, b: int, alpha: float) -> list[int]:
    """Textbook farthest-first (D^2) selection under d_alpha, one problem ``[n, D]``."""
    chosen = [int(torch.argmax(torch.linalg.vector_norm(seed_features(keys, values, alpha), dim=-1)))]
    dist = torch.full((keys.shape[0],), float("inf"), dtype=keys.dtype)
    while len(chosen) < b:
        j = chosen[-1]
        d = alpha * ((keys - keys[j]) ** 2).sum(-1) + (1 - alpha) * ((values - values[j]) ** 2).sum(-1)
        dist = torch.minimum(dist, d)
        dist[chosen] = -1.0
        chosen.append(int(torch.argmax(dist)))
    return chosen


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 40), d=st.integers(1, 6),
       alpha=st.sampled_from([0.0, 0.25, 0.6, 1.0]), novelty=st.sampled_from(["exact", "max_cosine"]),
       data=st.data())
def test_lambda_zero_is_pure_bicriteria_d2(seed: int, n: int, d: int, alpha: float, novelty: str,
                                           data: st.DataObject) -> None:
    b = data.draw(st.integers(1, n - 1))
    keys, values = random_kv(seed, 1, 1, n, d)
    res = get_selector("cords", lam=0.0, alpha=alpha, novelty=novelty).select(keys, values, b)
    assert res.order[0].tolist() == plain_d2(keys[0, 0], values[0, 0], b, alpha)


@SETTINGS
@given(case=cases(max_n=20), other=st.integers(0, 2**31 - 1),
       params=st.sampled_from([dict(lam=0.0), dict(eta=1.0), dict(eta=1.0, lam=2.0, novelty="exact")]))
def test_alpha_one_ignores_values(case: Case, other: int, params: dict) -> None:
    sel = get_selector("cords", alpha=1.0, **params)
    _, new_values = random_kv(other, *case.shape)
    a = sel.select(case.keys, case.values, case.budget, **case.kwargs())
    b = sel.select(case.keys, new_values, case.budget, **case.kwargs())
    assert torch.equal(a.keep, b.keep) and torch.equal(a.order, b.order)


@SETTINGS
@given(case=cases(max_n=20), other=st.integers(0, 2**31 - 1),
       params=st.sampled_from([dict(lam=0.0), dict(eta=0.0), dict(eta=0.0, lam=2.0, novelty="exact")]))
def test_alpha_zero_ignores_keys(case: Case, other: int, params: dict) -> None:
    sel = get_selector("cords", alpha=0.0, **params)
    new_keys, _ = random_kv(other, *case.shape)
    a = sel.select(case.keys, case.values, case.budget, **case.kwargs())
    b = sel.select(new_keys, case.values, case.budget, **case.kwargs())
    assert torch.equal(a.keep, b.keep) and torch.equal(a.order, b.order)


def test_values_matter_by_default() -> None:
    keys, values = random_kv(1, 1, 2, 64, 8)
    _, other = random_kv(2, 1, 2, 64, 8)
    sel = get_selector("cords")
    assert not torch.equal(sel.select(keys, values, 16).keep, sel.select(keys, other, 16).keep)


@SETTINGS
@given(case=cases(max_n=20))
def test_k_only_and_v_only_are_the_cords_endpoints(case: Case) -> None:
    for name, alpha in (("k_only", 1.0), ("v_only", 0.0)):
        a = get_selector(name).select(case.keys, case.values, case.budget, **case.kwargs())
        b = get_selector("cords", alpha=alpha, lam=0.0).select(case.keys, case.values, case.budget,
                                                                **case.kwargs())
        assert torch.equal(a.keep, b.keep) and torch.equal(a.order, b.order)


def test_seed_is_the_largest_key_plus_value() -> None:
    keys, values = random_kv(4, 2, 2, 50, 4)
    res = get_selector("cords").select(keys, values, 5)
    joint = (keys + values).permute(0, 2, 1, 3).reshape(2, 50, -1)
    assert res.order[:, 0].tolist() == torch.linalg.vector_norm(joint, dim=-1).argmax(-1).tolist()


def clustered(n_clusters: int, per_cluster: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Well-separated clusters, contiguous in time (cluster c holds tokens c*per .. (c+1)*per - 1)."""
    g = torch.Generator().manual_seed(seed)
    centres_k = 10.0 * torch.randn(n_clusters, 2, dim, generator=g)
    centres_v = 10.0 * torch.randn(n_clusters, 2, dim, generator=g)
    keys = centres_k.repeat_interleave(per_cluster, 0) + 0.1 * torch.randn(n_clusters * per_cluster, 2, dim,
                                                                          generator=g)
    values = centres_v.repeat_interleave(per_cluster, 0) + 0.1 * torch.randn(n_clusters * per_cluster, 2, dim,
                                                                            generator=g)
    return keys.permute(1, 0, 2)[None], values.permute(1, 0, 2)[None]


@pytest.mark.parametrize("novelty", ["exact", "max_cosine"])
@pytest.mark.parametrize("per_head", [False, True])
def test_covers_every_cluster_where_recency_does_not(novelty: str, per_head: bool) -> None:
    n_clusters, per = 8, 12
    cluster_of = torch.arange(n_clusters * per) // per
    for seed in range(3):
        keys, values = clustered(n_clusters, per, 8, seed)
        for budget in (n_clusters, n_clusters + 3, 2 * n_clusters):
            res = get_selector("cords", novelty=novelty).select(keys, values, budget, per_head=per_head)
            rows = res.keep.reshape(-1, keys.shape[2])
            for row in rows:
                assert set(cluster_of[row].tolist()) == set(range(n_clusters))
            rec = get_selector("recency").select(keys, values, budget, per_head=per_head)
            assert len(set(cluster_of[rec.keep.reshape(-1, keys.shape[2])[0]].tolist())) < n_clusters


def test_covers_every_cluster_at_frame_granularity() -> None:
    # Frames of 4 tokens; each cluster spans 3 frames; budget of one frame per cluster.
    keys, values = clustered(6, 12, 8, 0)
    res = get_selector("cords").select(keys, values, 6 * 4, granularity="frame", group_size=4)
    cluster_of = torch.arange(72) // 12
    assert set(cluster_of[res.keep[0]].tolist()) == set(range(6))
