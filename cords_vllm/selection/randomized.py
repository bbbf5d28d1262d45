"""Random: keep a uniformly random subset of candidates (seeded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.params import hyperparameter
from cords_vllm.selection.ranking import top_k_order
from cords_vllm.selection.registry import register_selector


@register_selector("random")
@dataclass(frozen=True)
class RandomSelector(Selector):
    """Keep ``b`` candidates drawn uniformly at random without replacement.

    Idea: the content-blind floor every policy must beat. Each unit gets an i.i.d. uniform score drawn
    on the CPU (so CPU and CUDA inputs give the same subset) and the ``b`` highest are kept. The scores
    reach a CUDA device through pinned memory, without blocking the host.
    Deterministic for a given seed and input shape; the draw covers the whole ``[P, M]`` batch, so
    the subset of one problem depends on how problems are batched.

    Paper: a standard baseline (the CoRDS feasibility notes use it as a reference).

    Parameters
    ----------
    seed:
        Seed of the generator created for every call when the caller passes no ``generator``.
    """

    stochastic = True

    seed: int = hyperparameter(0, low=0, high=2**63 - 1, help="random seed (used when no generator is given)")

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        gen = units.generator
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(self.seed)
        score = torch.rand(units.valid.shape, generator=gen, device=gen.device, dtype=torch.float64)
        device = units.valid.device
        if score.device.type == "cpu" and device.type == "cuda":
            score = score.pin_memory()  # so that the upload below never waits for the stream
        return top_k_order(score.to(device, non_blocking=True), units.valid, units.k, units.k_max)
