"""StreamMem's saliency: the attention that the chat template's tokens pay to the video tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.params import hyperparameter
from cords_vllm.selection.ranking import top_k_order
from cords_vllm.selection.registry import register_selector


@register_selector("streammem")
@dataclass(frozen=True)
class StreamMemSelector(Selector):
    """Keep the candidates a generic proxy query, the chat template's tokens, attends to most.

    Idea: a chat model's template tokens ("<|im_start|>user", the vision start marker, ...) are read before every
    question, so the attention they pay to a video token is a question-free estimate of its salience. Score every
    candidate by its mean softmax attention weight over the proxy's query rows and the query heads of its KV head
    (:func:`~cords_vllm.selection.observation.observed_attention`), keep the top ``b``.

    Paper: Yang et al., 2025, "StreamMem: Query-Agnostic KV Cache Memory for Streaming Video Understanding"
    (cross-attention from the chat template's tokens, top-k per compression, plus a merged prototype per frame and
    input-side frame filtering). How this form differs, and why:

    * The proxy is the ``proxy_tokens`` **text tokens right before the request's first video** (the template's
      system and user-turn tokens), their queries captured as the engine prefills them. StreamMem appends the
      template after each clip and runs it through the model; the engine cannot run extra tokens inside a step,
      so the proxy keeps its own place, and its rows attend to every token the compression reads (including the
      later video tokens, as the appended template would).
    * No frame prototypes (merged keys and values): the engine keeps original tokens at their own positions only,
      as every policy here does. No input-side frame filtering: vLLM's EVS (``--video-pruning-rate``) is that
      stage, and combines with any policy.
    * At frame/block granularity a unit scores the mean of its tokens' scores.

    Parameters
    ----------
    proxy_tokens:
        Text tokens before the first video whose queries are the proxy (the newest of them when the prompt has
        more).
    """

    needs_observation = True
    #: Where the engine takes the observation queries from: the text right before the first candidate.
    observation_source: ClassVar[str | None] = "prompt_before_candidates"

    proxy_tokens: int = hyperparameter(16, low=1, high=4096, help="text tokens before the first video whose "
                                                                 "queries are the proxy")

    @property
    def window(self) -> int:
        """Query rows the engine keeps per request and anchor layer."""
        return self.proxy_tokens

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        return top_k_order(units.scores, units.valid, units.k, units.k_max)
