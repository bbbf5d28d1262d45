"""Facts of the engine vLLM built, read by the engine core, the workers and the API server alike."""

from __future__ import annotations

import re
from typing import Any

from cords_vllm.compress.pipeline import attention_stages
from cords_vllm.model_facts import ModelFacts


def decoder_layer_index(name: str) -> int:
    """The decoder layer index in an attention layer's name (``model.layers.3.self_attn.attn`` -> 3)."""
    match = re.search(r"\.layers\.(\d+)\.", name)
    if match is None:
        raise ValueError(f"cannot find the decoder layer index in attention layer name {name!r}")
    return int(match.group(1))


def model_facts_of(vllm_config: Any) -> ModelFacts:
    """The :class:`~cords_vllm.model_facts.ModelFacts` of an engine's model."""
    mc = vllm_config.model_config
    return ModelFacts.from_hf_config(mc.hf_config, uses_mrope=bool(getattr(mc, "uses_mrope", False)),
                                     hybrid=bool(getattr(mc, "is_hybrid", False)))


def attention_stages_of(vllm_config: Any) -> list[range]:
    """Each pipeline stage's attention layers (what ``anchors`` index), in stage order, as vLLM splits the decoder
    layers (``get_pp_indices``, which ``VLLM_PP_LAYER_PARTITION`` may set); one range with one stage. A hybrid
    model's recurrent-state layers are not counted (Qwen3.5: three Gated DeltaNet layers to one attention layer)."""
    from vllm.distributed.utils import get_pp_indices

    mc = vllm_config.model_config
    size = vllm_config.parallel_config.pipeline_parallel_size
    total = mc.get_total_num_hidden_layers()
    types = getattr(mc.hf_text_config, "layer_types", None)
    return attention_stages([get_pp_indices(total, rank, size) for rank in range(size)],
                            types if mc.is_hybrid and types else None)
