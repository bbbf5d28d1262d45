"""The greedy kernel (:mod:`cords_vllm.selection.cords_triton`) keeps the PyTorch path's units, bit for bit.

Where no GPU is, on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``) at small
sizes: the same kernel source that runs on CUDA, executed element by element. With a GPU, compiled, on CUDA tensors,
against the PyTorch path on the same device. Every selector the kernel covers (CoRDS at its defaults and at the
corners of its parameters, with either novelty, k_only, v_only), every granularity, joint and per head, with and
without protected tokens, and with exact ties (duplicated tokens), where only the shared tie rule decides.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from kv_cases import Case, cases, random_candidates, random_kv

import cords_vllm.selection.cords_triton as cords_triton
from cords_vllm.kernel_backend import kernels_in_force
from cords_vllm.selection import get_selector

pytest.importorskip("triton")

#: (policy, hyper-parameters): what the kernel covers.
COVERED = [
    ("cords", {}),
    ("cords", {"space": "normalized"}),
    ("cords", {"lam": 0.0}),
    ("cords", {"alpha": 1.0, "eta": 0.0, "lam": 0.5}),
    ("cords", {"alpha": 0.0, "eta": 1.0, "lam": 1.0}),
    ("cords", {"alpha": 0.6, "eta": 1.0}),
    ("cords", {"alpha": 0.1, "eta": 0.0}),
    ("cords", {"novelty": "exact"}),
    ("cords", {"novelty": "exact", "alpha": 0.8, "eta": 0.0, "lam": 1.0}),
    ("k_only", {}),
    ("v_only", {}),
]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Problems each kernel launch ran (so a test sees that the kernel, not the fallback, chose)."""
    seen: list[int] = []
    original = cords_triton.cords_greedy_triton

    def spy(feats: torch.Tensor, *args, **kwargs):
        out = original(feats, *args, **kwargs)
        if out is not None:
            seen.append(feats.shape[0])
        return out

    monkeypatch.setattr(cords_triton, "cords_greedy_triton", spy)
    return seen


@pytest.fixture(params=["whole", "compacted"])
def pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test that takes it twice: at the kernel's own widths (these sizes step over the whole row), and with every
    run's steps going on over its pool alone once it fits in half the row (:data:`cords_triton.COMPACT_FROM` at the
    narrowest width). The exact novelty never packs its pool: its second run would repeat the first."""
    if request.param == "compacted":
        chosen = request.node.callspec.params
        if "exact" in (chosen.get("novelty"), chosen.get("params", {}).get("novelty")):
            pytest.skip("the exact novelty steps over the whole row")
        monkeypatch.setattr(cords_triton, "COMPACT_FROM", cords_triton.UNIT_ROWS)
    return request.param


#: Where the kernels run: compiled on a GPU, interpreted on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _both(policy: str, params: dict, keys: torch.Tensor, values: torch.Tensor, budget: int, **kwargs):
    selector = get_selector(policy, **params)
    keys, values = keys.to(DEVICE), values.to(DEVICE)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with kernels_in_force("torch"):
        reference = selector.select(keys, values, budget, **kwargs)
    with kernels_in_force("triton"):
        kernel = selector.select(keys, values, budget, **kwargs)
    return reference, kernel


@pytest.mark.parametrize(("policy", "params"), COVERED)
@pytest.mark.parametrize(("granularity", "group"), [("token", None), ("frame", 6), ("block", 4)])
@pytest.mark.parametrize("per_head", [False, True])
def test_kernel_keeps_the_reference_units(policy, params, granularity, group, per_head, launches, pool):
    keys, values = random_kv(3, 2, 2, 60, 8, torch.float32)
    cand = random_candidates(3, 2, 60)
    reference, kernel = _both(policy, params, keys, values, 20, candidates=cand, granularity=granularity,
                              group_size=group, per_head=per_head)
    assert launches, "the kernel did not run"
    assert torch.equal(kernel.order, reference.order)
    assert torch.equal(kernel.keep, reference.keep)


@pytest.mark.parametrize(("policy", "params"), COVERED[:3] + COVERED[7:9] + COVERED[-2:])
def test_exact_ties_follow_the_shared_tie_rule(policy, params, launches, pool):
    """Duplicated tokens (as a bf16 cache makes them) tie exactly: the lowest index wins in both paths."""
    keys, values = random_kv(5, 1, 2, 48, 8, torch.float32)
    keys[..., 24:, :], values[..., 24:, :] = keys[..., :24, :], values[..., :24, :]
    keys[..., 7, :], values[..., 7, :] = keys[..., 3, :], values[..., 3, :]
    reference, kernel = _both(policy, params, keys.bfloat16(), values.bfloat16(), 30)
    assert launches
    assert torch.equal(kernel.order, reference.order)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=cases(max_n=20, max_d=4, dtype=torch.float32))
@pytest.mark.parametrize("novelty", ["max_cosine", "exact"])
def test_kernel_equals_reference_on_random_problems(novelty: str, case: Case, launches, pool):
    reference, kernel = _both("cords", {"novelty": novelty}, case.keys, case.values, case.budget, **case.kwargs())
    assert torch.equal(kernel.order, reference.order)
    assert torch.equal(kernel.keep, reference.keep)


def test_what_the_kernel_does_not_take_runs_the_reference(launches):
    """float64 features have no kernel: the PyTorch path runs them."""
    keys, values = random_kv(1, 1, 2, 40, 8, torch.float64)
    for params in ({}, {"novelty": "exact"}):
        reference, kernel = _both("cords", params, keys, values, 12)
        assert torch.equal(kernel.order, reference.order)
    assert launches == []


def test_a_broken_kernel_is_caught(monkeypatch, launches):
    """The comparison can fail: a kernel whose tie slack is a thousand times too wide picks other units."""
    keys, values = random_kv(5, 1, 2, 48, 8, torch.float32)
    keys[..., 24:, :], values[..., 24:, :] = keys[..., :24, :], values[..., :24, :]
    original = cords_triton.snap_tolerance
    monkeypatch.setattr(cords_triton, "snap_tolerance", lambda dtype: 1e3 * original(dtype))
    reference, kernel = _both("cords", {}, keys, values, 30)
    assert launches
    assert not torch.equal(kernel.order, reference.order)


@pytest.mark.parametrize(("rank", "noise"), [(3, 0.0), (20, 1e-3)])
def test_the_exact_novelty_saturates_as_the_reference_does(rank, noise, launches):
    """Keys of rank below their width (plus a little noise): the residuals vanish after ``rank`` directions, or
    shrink towards the snap threshold, over the 60 steps of a run that goes past the width (32) of the space; both
    paths keep the same units. (Noise that puts residuals within rounding of the threshold itself, ``tol |x|^2``,
    can tip a snap either way, as any two summation orders can.)"""
    g = torch.Generator().manual_seed(rank)
    directions = torch.randn(2, 1, rank, 32, generator=g)
    keys = (torch.randn(2, 1, 150, rank, generator=g) @ directions).view(2, 150, 2, 16).permute(0, 2, 1, 3)
    keys = keys + noise * torch.randn(keys.shape, generator=g)
    values = torch.randn(2, 2, 150, 16, generator=g)
    for params in ({"novelty": "exact"}, {"novelty": "exact", "lam": 1.0, "eta": 1.0}):
        reference, kernel = _both("cords", params, keys.contiguous(), values, 60)
        assert torch.equal(kernel.order, reference.order)
    assert launches


@pytest.mark.parametrize(("tokens", "valid_tokens", "budget"), [(200, 200, 150), (200, 90, 60), (130, 130, 129)])
def test_a_run_goes_on_over_its_pool_alone_once_it_fits_in_half_the_row(tokens, valid_tokens, budget, monkeypatch):
    """A run of ``tokens`` units (256 wide) of which ``valid_tokens`` are candidates: once its pool (the candidates
    not yet chosen, the next one included) is 128 units or fewer, its steps go on over those alone, packed in index
    order, and it keeps the PyTorch path's units. From the start where the candidates are that few, after
    ``valid_tokens - 128`` steps otherwise (the packed indices are the pool's then), down to a pool of 1."""
    monkeypatch.setattr(cords_triton, "COMPACT_FROM", cords_triton.UNIT_ROWS)
    seen = []
    run = cords_triton.launch
    monkeypatch.setattr(cords_triton, "launch", lambda name, kernel, grid, *args, **kwargs: (
        seen.append(args), run(name, kernel, grid, *args, **kwargs))[1])
    g = torch.Generator().manual_seed(tokens + valid_tokens)
    keys, values = torch.randn(1, 2, tokens, 8, generator=g), torch.randn(1, 2, tokens, 8, generator=g)
    candidates = torch.zeros(1, tokens, dtype=torch.bool)
    candidates[0, torch.randperm(tokens, generator=g)[:valid_tokens]] = True
    reference, kernel = _both("cords", {}, keys, values, budget, candidates=candidates)
    assert torch.equal(kernel.order, reference.order)
    ids_at = list(inspect.signature(cords_triton._greedy_kernel).parameters).index("ids_ptr")
    ids = seen[-1][ids_at][0].cpu()  # the packed pool's indices, as the kernel wrote them
    before = max(valid_tokens - 128, 0)
    order = kernel.order.view(-1).cpu()
    pool_then = sorted(set(torch.nonzero(candidates[0]).view(-1).tolist()) - set(order[:before].tolist()))
    assert ids[:len(pool_then)].tolist() == pool_then
