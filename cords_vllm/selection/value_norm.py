"""Value norm: keep the candidates whose values have the largest norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.ranking import top_k_order
from cords_vllm.selection.registry import register_selector


@register_selector("value_norm")
@dataclass(frozen=True)
class ValueNormSelector(Selector):
    """Top-``b`` candidates by ``||v_i||`` (the value features of all heads, or of one head).

    Idea: a token's contribution to the attention output scales with its value norm, so large-norm
    values are treated as salient. At frame/block granularity the group's centroid value is scored.

    Paper: the value-norm ("VaN") saliency of InfiniPot-V (Kim et al., 2025) used on its own; a
    baseline of the CoRDS paper.

    Parameters
    ----------
    None.
    """

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        score = torch.linalg.vector_norm(units.values, dim=-1)
        return top_k_order(score, units.valid, units.k, units.k_max)
