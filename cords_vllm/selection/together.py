"""Several selections, one policy call: the greedy runs of a step's compressions ordered together.

A greedy policy's cost on a CPU is its per-step kernel overhead (about 30 small kernels per greedy step, whatever
the number of problems), not its arithmetic: ordering the units of every compression of an engine step in one
call costs about what one compression's order costs. The problems of different requests have different unit
counts and budgets; they are padded to a common unit count (padding units are invalid) and stacked, and each
gets back its own rows, cut to its own ``k_max``.

How a caller takes part: the selection of one compression runs as a *generator* (``Selector.select_steps``,
:func:`~cords_vllm.selection.exact.select_exact_steps`, and the compress step's own) that yields a piece of work
where several compressions' work is cheaper done at once (a :class:`Stackable`: :class:`UnitsToOrder`, its
policy's order; on the fused kernel path, its units' buffers and its greedy run,
:mod:`~cords_vllm.compress.step_triton`) and receives that work's result back.
:func:`run_alone` drives one such generator (what the plain functions do); :func:`run_together` drives several,
doing the work of every yield with the same :meth:`Stackable.stack_key` in one call.

Exactness: a policy may be batched this way only if it declares ``Selector.batches_problems``, which says that its
``_order_units`` reads nothing of a :class:`~cords_vllm.selection.batch.UnitBatch` but ``feats``, ``key_dim``,
``valid``, ``k`` and ``k_max``, treats every problem alone, and is unchanged by invalid units appended after a
problem's own (so a stacked call returns, row by row, the order each problem gets alone; checked bit for bit by
``tests/selection/test_together.py`` over the shared selector matrix).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

import torch

from cords_vllm.selection.batch import UnitBatch

if TYPE_CHECKING:
    from cords_vllm.selection.base import Selector

T = TypeVar("T")
P = ParamSpec("P")

#: A selection run as a generator: yields work (:class:`Stackable`), receives its result, returns its own.
SelectionSteps = Generator["Stackable", Any, T]


class Stackable(Protocol):
    """A piece of one compression's work that several compressions may do in one call."""

    def stack_key(self) -> Hashable | None:
        """Work with equal keys (and of one type) may be done in one :meth:`run_stack` call; ``None``: alone."""

    def run(self) -> Any:
        """Do this work alone; returns what the yielding generator receives."""

    @classmethod
    def run_stack(cls, items: Sequence[Any]) -> list[Any]:
        """Do the work of ``items`` (equal keys) in one call; returns each one's :meth:`run` result, in order."""


@dataclass(frozen=True)
class UnitsToOrder:
    """What a selection needs ordered: its policy and its units (``order = selector._order_units(units)``)."""

    selector: Selector
    units: UnitBatch

    def run(self) -> torch.Tensor:
        """This request's order alone: ``long [P, k_max]``."""
        return self.selector._order_units(self.units)

    def stack_key(self) -> Hashable | None:
        """Same policy, dtype, device and feature layout, for a policy that ``batches_problems``."""
        if not self.selector.batches_problems:
            return None
        feats = self.units.feats
        return self.selector, feats.dtype, feats.device, feats.shape[-1], self.units.key_dim

    @classmethod
    def run_stack(cls, items: Sequence[UnitsToOrder]) -> list[torch.Tensor]:
        """Every item's order (``long [P_r, k_max_r]`` each) from one policy call on their problems, stacked by
        :func:`stack_units`."""
        units = [item.units for item in items]
        order = items[0].selector._order_units(stack_units(units))
        out, row = [], 0
        for u in units:
            p_count = u.valid.shape[0]
            out.append(order[row:row + p_count, :u.k_max])
            row += p_count
        return out


def run_alone(steps: SelectionSteps[T]) -> T:
    """Drive one selection to its result, doing each piece of work it yields alone."""
    try:
        request = next(steps)
        while True:
            request = steps.send(request.run())
    except StopIteration as done:
        return done.value


def driven_alone(steps: Callable[P, SelectionSteps[T]], name: str, doc: str, *,
                 method: bool = False) -> Callable[P, T]:
    """The plain function of a selection generator: ``steps`` with the same arguments, driven by :func:`run_alone`
    to its result (one signature, written once, for both; ``inspect.signature`` follows ``steps``). ``name`` and
    ``doc``: the plain function's own. ``method``: ``steps`` is a method, looked up on the instance at each call (so
    a subclass's override is the one driven)."""

    @functools.wraps(steps)
    def alone(*args: P.args, **kwargs: P.kwargs) -> T:
        if method:
            self, *rest = args
            return run_alone(getattr(self, steps.__name__)(*rest, **kwargs))
        return run_alone(steps(*args, **kwargs))

    alone.__name__ = name
    alone.__qualname__ = steps.__qualname__.rsplit(".", 1)[0] + "." + name if "." in steps.__qualname__ else name
    alone.__doc__ = doc
    # What it returns is what the generator returns: SelectionSteps[X] -> X (annotations are strings here).
    signature = inspect.signature(steps)
    returns = signature.return_annotation
    if isinstance(returns, str) and returns.startswith("SelectionSteps[") and returns.endswith("]"):
        returns = returns[len("SelectionSteps["):-1]
    alone.__annotations__ = {**steps.__annotations__, "return": returns}
    alone.__signature__ = signature.replace(return_annotation=returns)
    return alone


def run_together(runs: Sequence[SelectionSteps[Any]]) -> list[Any]:
    """Drive several selections to their results, doing the work they yield at the same point in one call per
    type and :meth:`Stackable.stack_key`.

    Returns one entry per run: its result, or the exception it raised (each run fails alone, as it would have
    run alone; an exception while doing a stack's work is thrown into every run of that stack).
    """
    results: list[Any] = [None] * len(runs)
    waiting: dict[int, Stackable] = {}

    def advance(i: int, how: str, arg: Any = None) -> None:
        try:
            work = next(runs[i]) if how == "start" else getattr(runs[i], how)(arg)
        except StopIteration as done:
            results[i] = done.value
        except Exception as exc:  # this run's failure, reported to its caller
            results[i] = exc
        else:
            waiting[i] = work

    for i in range(len(runs)):
        advance(i, "start")
    while waiting:
        stacks: dict[Hashable, list[int]] = {}
        for i, work in waiting.items():
            key = work.stack_key()
            stacks.setdefault(("alone", i) if key is None else (type(work), key), []).append(i)
        current, waiting = waiting, {}
        for members in stacks.values():
            items = [current[i] for i in members]
            try:
                done = [items[0].run()] if len(items) == 1 else type(items[0]).run_stack(items)
            except Exception as exc:
                for i in members:
                    advance(i, "throw", exc)
                continue
            for i, result in zip(members, done, strict=True):
                advance(i, "send", result)
    return results


def stack_units(units: Sequence[UnitBatch]) -> UnitBatch:
    """One :class:`UnitBatch` of every problem of ``units`` (same dtype, device and feature layout), each padded
    to the largest unit count with invalid units (zero features, rank ``-1``).

    Only the fields a ``batches_problems`` policy reads are meaningful; the rest are the first batch's
    (``period``, ``granularity``, ``group_size``) or ``None``.
    """
    m_max = max(u.valid.shape[1] for u in units)

    def pad(x: torch.Tensor, value: float | bool | int) -> torch.Tensor:
        short = m_max - x.shape[1]
        if short == 0:
            return x
        filler = x.new_full((x.shape[0], short, *x.shape[2:]), value)
        return torch.cat([x, filler], dim=1)

    first = units[0]
    return UnitBatch(
        feats=torch.cat([pad(u.feats, 0.0) for u in units]), key_dim=first.key_dim,
        valid=torch.cat([pad(u.valid, False) for u in units]), rank=torch.cat([pad(u.rank, -1) for u in units]),
        count=torch.cat([u.count for u in units]), k=torch.cat([u.k for u in units]),
        k_max=max(u.k_max for u in units), period=first.period, granularity=first.granularity,
        group_size=first.group_size)
