"""The greedy D^2 run's constants and its snapping tolerance: what the reference (:mod:`.cords`) and the kernel
(:mod:`.cords_triton`) share, in a module of their own so that neither imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GreedyParams:
    """The greedy D^2 run's constants, for a policy the kernels run as it is (see
    :meth:`~cords_vllm.selection.base.Selector.greedy_params`): either novelty of
    :data:`~cords_vllm.selection.cords.NOVELTY_VARIANTS` (or none, ``lam = 0``), in either space of
    :data:`~cords_vllm.selection.cords.SPACES` (``"normalized"``: the units' features are scaled by
    :func:`~cords_vllm.selection.cords.normalized_features`'s rule before the run)."""

    alpha: float
    eta: float
    lam: float
    eps0: float
    novelty: str = "max_cosine"
    space: str = "paper"


def snap_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance below which distances, residuals and novelties count as exactly zero."""
    return 1e-12 if dtype == torch.float64 else 1e-4
