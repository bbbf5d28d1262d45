"""K-only and V-only D^2 farthest-first selection (the paper's feature-space ablation).

Both are CoRDS at an endpoint: ``alpha = 1`` (keys only) or ``alpha = 0`` (values only), without the
orthogonal bonus (``lam = 0``), seeded with the largest key (value) norm. They read only the keys
(values), so they ignore the other half of the cache entirely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.cords import GreedyParams, cords_greedy
from cords_vllm.selection.registry import register_selector


@dataclass(frozen=True)
class _D2Selector(Selector):
    """Greedy farthest-first (D^2) selection in one feature space."""

    alpha: ClassVar[float]
    batches_problems: ClassVar[bool] = True

    def greedy_params(self) -> GreedyParams:
        return GreedyParams(self.alpha, self.alpha, 0.0, 1e-6)

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        return cords_greedy(units.feats, units.key_dim, units.valid, units.k, units.k_max, alpha=self.alpha,
                            eta=self.alpha, lam=0.0, eps0=1e-6, novelty="exact")


@register_selector("k_only")
@dataclass(frozen=True)
class KOnlySelector(_D2Selector):
    """D^2 farthest-first selection in key space.

    Idea: seed with ``argmax ||k_i||``, then repeatedly keep the candidate farthest (squared Euclidean)
    from the kept keys. Preserves retrieval structure, ignores the content read out by attention.

    Paper: CoRDS, Table "design journey" step (ii), K-only; equals ``cords`` with ``alpha = 1, lam = 0``.

    Parameters
    ----------
    None.
    """

    alpha: ClassVar[float] = 1.0


@register_selector("v_only")
@dataclass(frozen=True)
class VOnlySelector(_D2Selector):
    """D^2 farthest-first selection in value space.

    Idea: seed with ``argmax ||v_i||``, then repeatedly keep the candidate farthest (squared Euclidean)
    from the kept values. Preserves output content, ignores which tokens queries retrieve.

    Paper: CoRDS, Table "design journey" step (ii), V-only; equals ``cords`` with ``alpha = 0, lam = 0``.

    Parameters
    ----------
    None.
    """

    alpha: ClassVar[float] = 0.0
