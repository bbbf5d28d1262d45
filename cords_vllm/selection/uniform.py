"""Uniform: keep evenly spaced candidates (every ``n/b``-th token, frame or block)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.ranking import mask_order
from cords_vllm.selection.registry import register_selector


@register_selector("uniform")
@dataclass(frozen=True)
class UniformSelector(Selector):
    """Keep ``b`` candidates evenly spaced in time.

    Idea: the ``t``-th kept unit (``t = 0..b-1``) is the one of rank ``floor((2t + 1) n / (2b))`` among
    the ``n`` candidate units, i.e. the centre of each of ``b`` equal slices of the candidate sequence.
    Content-blind; the classic frame-sampling baseline.

    Paper: CoRDS compares against "Uniform" in its compression-ratio sweep.

    Parameters
    ----------
    None.
    """

    uses_token_order = True

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        t = torch.arange(units.k_max, device=units.valid.device)[None, :]
        k = units.k[:, None].clamp_min(1)
        ranks = torch.div((2 * t + 1) * units.count[:, None], 2 * k, rounding_mode="floor")
        ranks = torch.minimum(ranks, (units.count[:, None] - 1).clamp_min(0))
        order = torch.gather(units.unit_at_rank(), 1, ranks)
        return mask_order(order, units.k)
