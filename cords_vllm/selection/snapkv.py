"""SnapKV, query-agnostic and streaming: the newest video tokens' queries vote for the older tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.params import hyperparameter
from cords_vllm.selection.ranking import top_k_order
from cords_vllm.selection.registry import register_selector


@register_selector("snapkv")
@dataclass(frozen=True)
class SnapKVSelector(Selector):
    """Keep the candidates the observation window attends to most, smoothed along time.

    Idea: the attention that the last few tokens of a prompt pay to the earlier ones predicts what generation will
    read. Score every candidate by its mean softmax attention weight over the window's query rows and the query
    heads of its KV head (:func:`~cords_vllm.selection.observation.observed_attention`), average the scores over
    ``kernel_size`` neighbouring candidates (so a kept token keeps its neighbourhood), keep the top ``b``.

    Paper: Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation" (window 32-64, pooling
    kernel 5-7; kvpress runs it with window 64, average pooling, kernel 5). How this form differs, and why:

    * The window is **the newest video tokens' queries** (``window`` of them, captured as the engine prefills
      them), never the question: the paper's streaming, query-agnostic form (the CoRDS paper's SnapKV-double-dagger,
      Case 3), since a stream's question comes after its video was compressed. SnapKV's own window is the last
      tokens of the prompt, question included (query-aware).
    * Each window row's softmax runs over the tokens the compression reads (the held region: kept video tokens and
      the protected text among them) and the rows never see tokens after their own (causal); the window's own
      keys, which SnapKV's softmax also covers, sit in the recent window the compression never reads.
    * Pooling runs along the candidates in time order at token granularity; at frame/block granularity a unit
      scores the mean of its tokens' scores and is not pooled.

    Parameters
    ----------
    window:
        Query rows of the observation window: the newest video tokens whose queries the engine keeps per request
        and anchor layer (memory: ``window * num_query_heads * head_dim`` elements each).
    kernel_size:
        Width of the average pooling of the scores along the candidates (odd; 1 = none).
    """

    needs_observation = True
    uses_token_order = True  # the pooling runs along time
    #: Where the engine takes the observation queries from: the newest candidate (video) tokens.
    observation_source: ClassVar[str | None] = "newest_candidates"

    window: int = hyperparameter(64, low=1, high=4096, help="query rows of the observation window (newest video "
                                                            "tokens)")
    kernel_size: int = hyperparameter(5, low=1, high=63, help="average pooling width along the candidates (odd)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel_size % 2 == 0:
            raise ValueError(f"{self.name}: parameter 'kernel_size' must be odd, got {self.kernel_size}")

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        scores = units.scores
        if units.granularity == "token" and self.kernel_size > 1:
            scores = pooled_along_time(scores, units, self.kernel_size)
        return top_k_order(scores, units.valid, units.k, units.k_max)


def pooled_along_time(scores: torch.Tensor, units: UnitBatch, kernel_size: int) -> torch.Tensor:
    """``[P, M]``: each valid unit's score averaged over the ``kernel_size`` units nearest in time (rank order),
    padding with zeros at both ends (average pooling with the padding counted, as SnapKV pools)."""
    at_rank = units.unit_at_rank()  # [P, M], -1 past count
    in_time = torch.where(at_rank >= 0, torch.gather(scores, 1, at_rank.clamp_min(0)), 0.0)
    pooled = F.avg_pool1d(in_time[:, None, :], kernel_size, stride=1, padding=kernel_size // 2)[:, 0]
    return torch.where(units.valid, torch.gather(pooled, 1, units.rank.clamp_min(0)), 0.0)
