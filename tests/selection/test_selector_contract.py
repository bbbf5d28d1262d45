"""The shared test matrix: every registered selector through the same contract tests.

A policy added to the registry is tested here the moment it is registered.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_cases import Case, cases, expected_kept, policy_inputs, random_candidates, random_kv

from cords_vllm.selection import available_selectors, get_selector

SELECTORS = available_selectors()
DETERMINISTIC = [n for n in SELECTORS if not get_selector(n).stochastic]
EQUIVARIANT = [n for n in DETERMINISTIC if not get_selector(n).uses_token_order]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _select(name: str, case: Case, **extra):
    sel = get_selector(name)
    kwargs = case.kwargs()
    if sel.needs_frame_length and case.group_size is None:
        kwargs["group_size"] = 4  # e.g. InfiniPot-V reads the frame length at token granularity
    kwargs.update(policy_inputs(sel, case.keys))
    kwargs.update(extra)
    return sel.select(case.keys, case.values, case.budget, **kwargs)


@pytest.mark.parametrize("name", SELECTORS)
@SETTINGS
@given(case=cases())
def test_exact_count_protected_and_valid_order(name: str, case: Case) -> None:
    res = _select(name, case)
    b, h, n, _ = case.shape
    lead = (b, h) if case.per_head else (b,)
    assert res.keep.shape == (*lead, n) and res.keep.dtype == torch.bool
    want = expected_kept(case)
    assert torch.equal(res.num_kept, want if not case.per_head else want[:, None].expand(b, h))
    # Protected tokens are always kept.
    if case.candidates is not None:
        prot = ~case.candidates if not case.per_head else ~case.candidates[:, None, :].expand(b, h, n)
        assert bool(res.keep[prot].all())
    # The order lists distinct, in-range units (tokens that are candidates at token granularity).
    flat = res.order.flatten(0, -2)
    for row in flat:
        units = [int(u) for u in row if int(u) >= 0]
        assert len(units) == len(set(units))
        assert all(0 <= u < max(n, 1) for u in units)
        assert all(int(u) == -1 for u in row[len(units):])
    # Rectangular indices when every problem keeps the same count.
    if bool((res.num_kept == res.num_kept.reshape(-1)[0]).all()) if res.num_kept.numel() else False:
        idx = res.kept_indices()
        assert idx.shape[-1] == int(res.num_kept.reshape(-1)[0])
        assert bool(torch.gather(res.keep, -1, idx).all())
        assert bool((idx[..., 1:] > idx[..., :-1]).all())


@pytest.mark.parametrize("name", SELECTORS)
@SETTINGS
@given(case=cases(), extra=st.integers(0, 3))
def test_budget_covering_candidates_keeps_everything(name: str, case: Case, extra: int) -> None:
    n = case.shape[2]
    big = Case(case.keys, case.values, case.candidates, n + extra, case.granularity, case.group_size,
               case.per_head)
    res = _select(name, big)
    assert bool(res.keep.all())
    assert bool((res.order == -1).all())


@pytest.mark.parametrize("name", SELECTORS)
def test_budget_zero_keeps_only_protected(name: str) -> None:
    keys, values = random_kv(3, 2, 2, 20, 4)
    cand = random_candidates(3, 2, 20)
    for gran, g in (("token", 4), ("frame", 4), ("block", 3)):
        sel = get_selector(name)
        res = sel.select(keys, values, 0, candidates=cand, granularity=gran, group_size=g, **policy_inputs(sel, keys))
        assert torch.equal(res.keep, ~cand)


@pytest.mark.parametrize("name", DETERMINISTIC)
@SETTINGS
@given(case=cases(max_n=16))
def test_deterministic_and_independent_of_the_batch(name: str, case: Case) -> None:
    res = _select(name, case)
    again = _select(name, case)
    assert torch.equal(res.keep, again.keep) and torch.equal(res.order, again.order)
    # Each problem alone gives the same answer as inside the batch.
    b = case.shape[0]
    for i in range(b):
        one = Case(case.keys[i:i + 1], case.values[i:i + 1],
                   None if case.candidates is None else case.candidates[i:i + 1],
                   case.budget, case.granularity, case.group_size, case.per_head)
        alone = _select(name, one)
        assert torch.equal(alone.keep[0], res.keep[i])
        width = alone.order.shape[-1]
        assert torch.equal(alone.order[0], res.order[i][..., :width])


@pytest.mark.parametrize("name", EQUIVARIANT)
@SETTINGS
@given(case=cases(max_n=16, token_only=True), perm_seed=st.integers(0, 2**31 - 1))
def test_permuting_tokens_permutes_the_kept_set(name: str, case: Case, perm_seed: int) -> None:
    n = case.shape[2]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(perm_seed))
    cand = case.candidates
    permuted = Case(case.keys[:, :, perm], case.values[:, :, perm], None if cand is None else cand[:, perm],
                    case.budget, "token", None, case.per_head)
    res = _select(name, case)
    res_p = _select(name, permuted)
    assert torch.equal(res_p.keep, res.keep[..., perm])


@pytest.mark.parametrize("name", SELECTORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(name: str, dtype: torch.dtype) -> None:
    keys, values = random_kv(5, 2, 2, 64, 8, dtype)
    cand = random_candidates(5, 2, 64)
    sel = get_selector(name)
    res = sel.select(keys, values, 10, candidates=cand, granularity="token", group_size=8, **policy_inputs(sel, keys))
    assert torch.equal(res.num_kept, (~cand).sum(-1) + 10)


@pytest.mark.parametrize("name", SELECTORS)
def test_generator_only_matters_for_stochastic_policies(name: str) -> None:
    keys, values = random_kv(11, 1, 2, 40, 4)
    sel = get_selector(name)
    kw = dict(granularity="token", group_size=4, **policy_inputs(sel, keys))
    a = sel.select(keys, values, 9, generator=torch.Generator().manual_seed(1), **kw)
    b = sel.select(keys, values, 9, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(a.keep, b.keep)
    if not sel.stochastic:
        c = sel.select(keys, values, 9, generator=torch.Generator().manual_seed(2), **kw)
        assert torch.equal(a.keep, c.keep)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", SELECTORS)
def test_cuda_matches_cpu(name: str) -> None:
    keys, values = random_kv(13, 2, 2, 96, 16, torch.float32)
    cand = random_candidates(13, 2, 96)
    sel = get_selector(name)
    for gran, g in (("token", 8), ("frame", 8), ("block", 16)):
        cpu = sel.select(keys, values, 32, candidates=cand, granularity=gran, group_size=g,
                         **policy_inputs(sel, keys))
        gpu = sel.select(keys.cuda(), values.cuda(), 32, candidates=cand.cuda(), granularity=gran,
                         group_size=g, **policy_inputs(sel, keys.cuda()))
        assert gpu.keep.is_cuda
        assert torch.equal(gpu.num_kept.cpu(), cpu.num_kept)
        if sel.name in ("uniform", "recency", "random"):
            assert torch.equal(gpu.keep.cpu(), cpu.keep)
