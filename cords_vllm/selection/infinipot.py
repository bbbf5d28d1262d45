"""InfiniPot's text-side scoring: a catalyst prompt placed after the newest token votes for what to keep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.params import hyperparameter
from cords_vllm.selection.ranking import top_k_order
from cords_vllm.selection.registry import register_selector


@register_selector("infinipot")
@dataclass(frozen=True)
class InfiniPotSelector(Selector):
    """Keep the candidates a catalyst prompt, read right after the newest token, attends to most.

    Idea: at each compression, append a short generic prompt (the catalyst, CaP) after the context; the attention its
    tokens pay to the cached tokens estimates what any later text will need. Score every candidate by its mean
    softmax attention weight over the catalyst's query rows and the query heads of its KV head
    (:func:`~cords_vllm.selection.observation.observed_attention`), keep the top ``b``.

    Paper: Kim et al., 2024, "InfiniPot: Infinite Context Processing on Memory-Constrained LLMs" (continual context
    distillation with the catalyst prompt's attention, CaP, and novelty under compression, NuC). How this form
    differs, and why:

    * The catalyst is the request's own **text right before its first video** (``catalyst_tokens`` of it: the chat
      template's system and user-turn tokens), whose queries the engine keeps as it prefills them, **rotated to the
      position right after the newest token** at each compression (their positions moved by the same angle on every
      rotary section, which is where a text token appended there would sit). InfiniPot runs a fixed catalyst text
      through the model after the context; the engine cannot run extra tokens inside a step, so the catalyst's
      hidden states are those of the prompt's own text, which has not read the video. That placement is the
      difference from ``streammem``, whose proxy keeps its own place.
    * No NuC: it scores a token by how hard the model found it to predict, which video tokens (embeddings, not
      sampled text) do not have. The CoRDS paper's InfiniPot baseline is this text-side score.
    * At frame/block granularity a unit scores the mean of its tokens' scores.

    Parameters
    ----------
    catalyst_tokens:
        Text tokens before the first video whose queries are the catalyst (the newest of them when the prompt has
        more).
    """

    needs_observation = True
    #: Where the engine takes the observation queries from: the text right before the first candidate, rotated to
    #: the position after the newest token.
    observation_source: ClassVar[str | None] = "prompt_at_newest"

    catalyst_tokens: int = hyperparameter(16, low=1, high=4096, help="text tokens before the first video whose "
                                                                     "queries are the catalyst")

    @property
    def window(self) -> int:
        """Query rows the engine keeps per request and anchor layer."""
        return self.catalyst_tokens

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        return top_k_order(units.scores, units.valid, units.k, units.k_max)
