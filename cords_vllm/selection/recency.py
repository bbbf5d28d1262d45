"""Recency: a sliding window over the most recent candidates, plus attention-sink candidates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.params import hyperparameter
from cords_vllm.selection.ranking import mask_order
from cords_vllm.selection.registry import register_selector


@register_selector("recency")
@dataclass(frozen=True)
class RecencySelector(Selector):
    """Keep the ``sinks`` oldest candidates and the most recent ones (StreamingLLM-style window).

    Idea: attention concentrates on a few initial "sink" tokens and on the recent past; keep exactly
    those. The sinks count against the budget: with budget ``b`` the policy keeps candidate units of
    rank ``0 .. s-1`` and ``n-(b-s) .. n-1`` where ``s = min(sinks, b)``.

    Paper: StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention
    Sinks"); the recency baseline of the CoRDS paper.

    Parameters
    ----------
    sinks:
        Number of leading candidate units (tokens, or frames/blocks at group granularity) always kept,
        ``>= 0``. Default 0: in this product the real sinks (system prompt, text before the video) are
        protected tokens outside the candidate set, so the window is purely recent video.
    """

    uses_token_order = True

    sinks: int = hyperparameter(0, low=0, help="leading candidate units always kept (count against budget)")

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        t = torch.arange(units.k_max, device=units.valid.device)[None, :]
        k, n = units.k[:, None], units.count[:, None]
        s = torch.clamp(k, max=self.sinks)
        ranks = torch.where(t < s, t, n - k + t)
        ranks = ranks.clamp(0, max(units.valid.shape[1] - 1, 0))
        order = torch.gather(units.unit_at_rank(), 1, ranks)
        return mask_order(order, units.k)
