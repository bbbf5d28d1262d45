"""Engine checks shared by the scheduler and worker sides."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cords_vllm.config import KVPolicyConfig


def single_kv_cache_group(groups: Sequence[Any], config: KVPolicyConfig) -> Any:
    """The one KV cache group of the model; refuses hybrid and sliding-window models (several groups)."""
    if len(groups) != 1:
        raise NotImplementedError(
            f"--kv-policy {config.policy}: models with {len(groups)} KV cache groups (hybrid or sliding-window "
            "attention) are not supported; cords-vllm compresses one full-attention KV cache group")
    return groups[0]
