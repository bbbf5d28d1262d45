"""Attention-output error of a compressed cache and the Proposition 1 bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cords_vllm.lab.fidelity import attention_error, nearest_kept
from cords_vllm.selection import get_selector

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def qkv(seed: int, b: int, hq: int, h: int, q: int, n: int, d: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, q, d, generator=g, dtype=dtype),
            torch.randn(b, h, n, d, generator=g, dtype=dtype),
            torch.randn(b, h, n, d, generator=g, dtype=dtype))


@pytest.mark.parametrize("per_head_mask", [False, True])
def test_zero_error_when_nothing_is_dropped(per_head_mask: bool) -> None:
    q, k, v = qkv(0, 2, 4, 2, 5, 30, 8, torch.float32)
    keep = torch.ones(2, 2, 30, dtype=torch.bool) if per_head_mask else torch.ones(2, 30, dtype=torch.bool)
    err = attention_error(q, k, v, keep)
    for field in ("drop", "cluster", "cluster_abs", "bound", "bound_values"):
        assert torch.equal(getattr(err, field), torch.zeros(2, 4, 5)), field


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), d=st.integers(1, 8), group=st.integers(1, 3),
       alpha=st.sampled_from([0.0, 0.25, 0.5, 0.9]), p=st.sampled_from([0.1, 0.5, 0.9]),
       per_head_mask=st.booleans(), scale=st.sampled_from([None, 3.0]))
def test_proposition_1_bound_holds(seed: int, n: int, d: int, group: int, alpha: float, p: float,
                                   per_head_mask: bool, scale: float | None) -> None:
    q, k, v = qkv(seed, 2, 2 * group, 2, 6, n, d)
    shape = (2, 2, n) if per_head_mask else (2, n)
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < p
    keep[..., 0] = True
    err = attention_error(q, k, v, keep, alpha=alpha, scale=scale)
    slack = 1e-9
    assert bool((err.cluster_abs <= err.bound_values + slack).all())
    assert bool((err.bound_values <= err.bound + slack).all())
    assert bool((err.drop >= 0).all()) and bool(torch.isfinite(err.drop).all())


def test_cluster_assignment_is_the_d_alpha_nearest() -> None:
    _, k, v = qkv(1, 1, 1, 1, 1, 25, 4)
    keep = torch.zeros(1, 25, dtype=torch.bool)
    keep[0, [3, 11, 20]] = True
    alpha = 0.25
    feats = torch.cat([alpha ** 0.5 * k[0], (1 - alpha) ** 0.5 * v[0]], -1)
    idx, dist = nearest_kept(feats, keep)
    for i in range(25):
        d = [alpha * float(((k[0, 0, i] - k[0, 0, j]) ** 2).sum())
             + (1 - alpha) * float(((v[0, 0, i] - v[0, 0, j]) ** 2).sum()) for j in (3, 11, 20)]
        assert int(idx[0, i]) == (3, 11, 20)[min(range(3), key=d.__getitem__)]
        assert abs(float(dist[0, i]) - min(d)) < 1e-9


def test_more_kept_means_smaller_error_on_average() -> None:
    q, k, v = qkv(2, 1, 2, 2, 64, 256, 16)
    errs = []
    for budget in (16, 64, 192):
        res = get_selector("cords").select(k, v, budget)
        errs.append(float(attention_error(q, k, v, res.keep).cluster.mean()))
    assert errs[0] > errs[1] > errs[2]


def test_bad_inputs_name_the_argument() -> None:
    q, k, v = qkv(3, 1, 2, 2, 3, 10, 4)
    keep = torch.ones(1, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="queries"):
        attention_error(q[..., :3], k, v, keep)
    with pytest.raises(ValueError, match="queries"):
        attention_error(q[:, :1].expand(1, 3, 3, 4).contiguous(), k, v, keep)
    with pytest.raises(ValueError, match="values"):
        attention_error(q, k, v[:, :, :5], keep)
    with pytest.raises(ValueError, match="keep"):
        attention_error(q, k, v, keep.float())
    with pytest.raises(ValueError, match="keep"):
        attention_error(q, k, v, torch.zeros(1, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="alpha"):
        attention_error(q, k, v, keep, alpha=1.0)
    bad = k.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="keys: contains NaN"):
        attention_error(q, bad, v, keep)
