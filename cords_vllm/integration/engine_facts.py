"""Facts of the engine vLLM built, read by the engine core, the workers and the API server alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cords_vllm.config import KVPolicyConfig
from cords_vllm.model_facts import ModelFacts


def model_facts_of(vllm_config: Any) -> ModelFacts:
    """The :class:`~cords_vllm.model_facts.ModelFacts` of an engine's model."""
    mc = vllm_config.model_config
    return ModelFacts.from_hf_config(mc.hf_config, uses_mrope=bool(getattr(mc, "uses_mrope", False)))


def single_kv_cache_group(groups: Sequence[Any], config: KVPolicyConfig) -> Any:
    """The one KV cache group of the model; refuses hybrid and sliding-window models (several groups)."""
    if len(groups) != 1:
        raise NotImplementedError(
            f"--kv-policy {config.policy}: models with {len(groups)} KV cache groups (hybrid or sliding-window "
            "attention) are not supported; cords-vllm compresses one full-attention KV cache group")
    return groups[0]
