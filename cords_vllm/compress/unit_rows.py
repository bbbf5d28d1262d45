"""Where the fused compress step (:mod:`cords_vllm.compress.step_triton`) writes a compression's units: their
buffers (:class:`UnitRows`), a compression's own or rows of buffers a step's compressions share, and the work item
that makes them (:class:`UnitRowsToMake`, a :class:`~cords_vllm.selection.together.Stackable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class UnitRows:
    """Where a compression's units go: ``feats`` ``float32 [P, M, 2W]``, ``norms`` ``float32 [3, P, M]`` (key, value
    and seed norms), ``valid`` ``int8 [P, M]``, ``k`` ``long [P]``; rows ``[start, stop)`` of ``stack``'s when a step's
    compressions share them (``M`` then the step's largest unit count), else the compression's own (``stack`` is
    ``None``); ``M`` a multiple of :data:`~cords_vllm.selection.cords_triton.UNIT_ROWS`, the units past a problem's
    own count invalid."""

    feats: torch.Tensor
    norms: torch.Tensor
    valid: torch.Tensor
    k: torch.Tensor
    stack: UnitRows | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class UnitRowsToMake:
    """A fused compression's units' buffers (:class:`~cords_vllm.selection.together.Stackable`): its own, or, for a
    step's compressions together, rows of buffers they share, zero-filled (one launch) so that each problem's units
    past its own count are invalid, and ordered by one greedy launch
    (:class:`~cords_vllm.compress.step_triton.GreedyOnRows`)."""

    device: torch.device
    problems: int
    units: int
    width: int

    def stack_key(self) -> tuple:
        return self.device, self.width

    def run(self) -> UnitRows:
        p, m, w = self.problems, self.units, self.width
        norms = torch.empty((3, p, m), dtype=torch.float32, device=self.device)
        return UnitRows(torch.empty((p, m, 2 * w), dtype=torch.float32, device=self.device), norms,
                         torch.empty((p, m), dtype=torch.int8, device=self.device),
                         torch.empty((p,), dtype=torch.long, device=self.device))

    @classmethod
    def run_stack(cls, items: Sequence[UnitRowsToMake]) -> list[UnitRows]:
        first = items[0]
        p, m, w = sum(i.problems for i in items), max(i.units for i in items), first.width
        n_feats, n_norms = p * m * 2 * w, 3 * p * m
        raw = torch.zeros(8 * p + 4 * (n_feats + n_norms) + p * m, dtype=torch.uint8, device=first.device)
        floats = raw[8 * p: 8 * p + 4 * (n_feats + n_norms)].view(torch.float32)
        stack = UnitRows(floats[:n_feats].view(p, m, 2 * w), floats[n_feats:].view(3, p, m),
                          raw[8 * p + 4 * (n_feats + n_norms):].view(torch.int8).view(p, m),
                          raw[: 8 * p].view(torch.long))
        out, start = [], 0
        for item in items:
            stop = start + item.problems
            out.append(UnitRows(stack.feats[start:stop], stack.norms[:, start:stop], stack.valid[start:stop],
                                 stack.k[start:stop], stack, start, stop))
            start = stop
        return out
