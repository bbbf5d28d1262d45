"""Several selections ordered in one policy call (:mod:`cords_vllm.selection.together`): each gets, bit for bit, what
it gets alone, whatever its unit count, budget or granularity; failures stay each selection's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from cords_vllm.selection import available_selectors, get_selector
from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.ranking import mask_order
from cords_vllm.selection.together import UnitsToOrder, run_alone, run_together, stack_units

H, D = 2, 8

#: Every policy that declares it may be stacked, and the CoRDS settings that change its greedy run.
STACKED = [*sorted(name for name in available_selectors() if get_selector(name).batches_problems),
           "cords:space=normalized", "cords:novelty=exact", "cords:lam=0", "cords:alpha=1,eta=1",
           "cords:alpha=0,lam=0.5"]


def _selector(spec: str) -> Selector:
    name, _, params = spec.partition(":")
    kwargs = {k: (v if v.isalpha() else float(v)) for k, v in (p.split("=") for p in params.split(",") if p)}
    return get_selector(name, **kwargs)


def _problems(seed: int) -> list[dict]:
    """Selections of different sizes, budgets and granularities (a step's compressions)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, budget, granularity in ((40, 12, "token"), (72, 24, "block"), (56, 16, "frame"), (24, 5, "token"),
                                   (96, 40, "frame")):
        keys, values = torch.randn(2, 1, H, n, D, generator=g).unbind(0)
        if seed % 2:  # exact ties
            keys, values = keys.round(), values.round()
        candidates = torch.ones(1, n, dtype=torch.bool)
        candidates[:, :3] = False
        kwargs = dict(candidates=candidates, granularity=granularity)
        if granularity != "token":
            kwargs["group_size"] = 8
        if granularity == "frame":  # labelled frames, some cut short
            sizes = torch.randint(3, 9, (n,), generator=g)
            kwargs["group_index"] = torch.repeat_interleave(torch.arange(n), sizes)[:n][None]
        out.append(dict(keys=keys, values=values, budget=budget, **kwargs))
    return out


def _differences(selector: Selector, problems: list[dict]) -> list[int]:
    """Problems whose selection run together with the others differs from the one it gets alone."""
    alone = [selector.select(**p) for p in problems]
    together = run_together([selector.select_steps(**p) for p in problems])
    return [i for i, (a, t) in enumerate(zip(alone, together, strict=True))
            if not (torch.equal(a.keep, t.keep) and torch.equal(a.order, t.order))]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spec", STACKED)
def test_stacked_selections_equal_each_alone_in_one_policy_call(spec, seed, monkeypatch):
    selector = _selector(spec)
    calls = []
    original = type(selector)._order_units
    monkeypatch.setattr(type(selector), "_order_units", lambda self, units: calls.append(units) or
                        original(self, units))
    problems = _problems(seed)
    assert _differences(selector, problems) == []
    assert len(calls) == len(problems) + 1  # each alone, then all five together
    assert calls[-1].valid.shape[0] == len(problems)


def test_the_policies_that_stack_are_the_greedy_ones():
    stacking = {n for n in available_selectors() if get_selector(n).batches_problems}
    assert stacking == {"cords", "cords_layerwise", "k_only", "v_only"}


@dataclass(frozen=True)
class _BatchScaled(Selector):
    """A policy that wrongly claims to stack: it scores by norm relative to the batch's largest (a negative
    control: quantised, its ties then depend on the other problems)."""

    name: ClassVar[str] = "batch_scaled"
    batches_problems: ClassVar[bool] = True

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        norm = units.feats.norm(dim=-1)
        score = torch.round(4 * norm / norm.max()).masked_fill(~units.valid, -1.0)
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :units.k_max]
        return mask_order(order, units.k)


def test_a_policy_whose_order_depends_on_the_batch_is_caught():
    assert _differences(_BatchScaled(), _problems(0)) != []


def test_a_selection_that_fails_fails_alone():
    selector = get_selector("cords")
    problems = _problems(0)
    bad = dict(problems[1], keys=problems[1]["keys"][..., :4])  # keys and values of different widths
    results = run_together([selector.select_steps(**p) for p in [problems[0], bad, problems[2]]])
    assert isinstance(results[1], ValueError)
    for got, p in zip((results[0], results[2]), (problems[0], problems[2]), strict=True):
        assert torch.equal(got.keep, selector.select(**p).keep)


def test_an_error_while_ordering_a_stack_reaches_every_selection_of_it(monkeypatch):
    selector = get_selector("k_only")

    def broken(self, units):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(type(selector), "_order_units", broken)
    results = run_together([selector.select_steps(**p) for p in _problems(0)[:3]])
    assert all(isinstance(r, RuntimeError) and "out of memory" in str(r) for r in results)


def test_padding_is_invalid_and_each_problem_keeps_its_budget():
    selector = get_selector("cords")
    problems = _problems(0)[:2]
    units = []
    for p in problems:
        request = next(selector.select_steps(**p))
        assert isinstance(request, UnitsToOrder)
        units.append(request.units)
    stacked = stack_units(units)
    m_max = max(u.valid.shape[1] for u in units)
    assert stacked.valid.shape == (2, m_max) and stacked.k.tolist() == [int(u.k) for u in units]
    assert int(stacked.valid.sum()) == sum(int(u.valid.sum()) for u in units)
    assert stacked.k_max == max(u.k_max for u in units)


def test_run_alone_is_select():
    selector = get_selector("cords")
    for p in _problems(1):
        assert torch.equal(run_alone(selector.select_steps(**p)).keep, selector.select(**p).keep)


@pytest.mark.parametrize("spec", ["cords", "v_only"])
def test_stacked_under_the_greedy_kernel_equal_each_alone(spec):
    """Where the greedy run is the Triton kernel (CUDA; here Triton's interpreter), a stack of problems padded to a
    common unit count is one launch and each problem keeps what it keeps alone."""
    from cords_vllm.kernel_backend import kernels_in_force

    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, else interpreted
    problems = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
                for p in _problems(1) if p["granularity"] != "token"]  # few units: quick under the interpreter
    with kernels_in_force("triton"):
        assert _differences(_selector(spec), problems) == []


def test_the_plain_functions_are_their_generators_driven_alone():
    """``Selector.select``, ``select_exact`` and ``select_positions`` take their generators' arguments (one
    signature, written once) and return what the generator returns; ``select`` drives the instance's own
    ``select_steps``, a subclass's override included."""
    import inspect

    from cords_vllm.compress.step import select_positions, select_positions_steps
    from cords_vllm.selection.exact import select_exact, select_exact_steps

    for plain, steps, returns in ((Selector.select, Selector.select_steps, "SelectionResult"),
                                  (select_exact, select_exact_steps, "torch.Tensor"),
                                  (select_positions, select_positions_steps, "torch.Tensor")):
        assert list(inspect.signature(plain).parameters) == list(inspect.signature(steps).parameters)
        assert inspect.signature(plain).return_annotation == returns
    assert Selector.select.__qualname__ == "Selector.select" and select_exact.__name__ == "select_exact"

    @dataclass(frozen=True)
    class Overridden(Selector):
        name: ClassVar[str] = "overridden"

        def select_steps(self, *args, **kwargs):
            yield from ()
            return "the override's result"

        def _order_units(self, units: UnitBatch) -> torch.Tensor:  # pragma: no cover - never reached
            raise AssertionError

    assert Overridden().select(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), 2) == "the override's result"
