"""Facts of the engine vLLM built, read by the engine core, the workers and the API server alike."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from cords_vllm.compress.pipeline import attention_stages
from cords_vllm.config import KVPolicyConfig
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


def attention_group_index(specs: Sequence[Any], config: KVPolicyConfig | None = None) -> int:
    """The index of the one KV cache group the policy compresses, among the engine's groups' ``specs``
    (``KVCacheSpec`` each, in vLLM's group order).

    A model has one full-attention group; a hybrid model (Qwen3.5: Gated DeltaNet layers) also has groups of
    fixed-size recurrent state (``MambaSpec``), which hold no per-token KV and are left alone. Under layer-selective
    compression the compressed layers' group (:class:`~cords_vllm.integration.kv_groups.CompressedAttentionSpec`)
    is the one, and full-attention groups beside it are kept whole (:func:`whole_group_indices`). Anything else (a
    second attention group: sliding-window, chunked-local or MLA layers beside full attention) is refused.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    from cords_vllm.integration.kv_groups import is_compressed

    compressed = [i for i, spec in enumerate(specs) if is_compressed(spec)]
    if compressed:
        attention = compressed
        others = [type(spec).__name__ for i, spec in enumerate(specs)
                  if i not in compressed and type(spec) is not FullAttentionSpec]
    else:
        attention = [i for i, spec in enumerate(specs)
                     if isinstance(spec, FullAttentionSpec) and not isinstance(spec, MLAAttentionSpec)]
        others = [type(spec).__name__ for i, spec in enumerate(specs)
                  if i not in attention and not isinstance(spec, MambaSpec)]
    if len(attention) != 1 or others:
        kinds = ", ".join(type(spec).__name__ for spec in specs)
        policy = config.policy if config is not None else "cords"
        raise NotImplementedError(
            f"--kv-policy {policy}: this model's KV cache groups are [{kinds}]; cords-vllm compresses one "
            "full-attention KV cache group, beside which only fixed-size state groups (Mamba, Gated DeltaNet) or, "
            "under layer-selective compression, whole full-attention groups may exist")
    return attention[0]


def whole_group_indices(specs: Sequence[Any]) -> list[int]:
    """The full-attention KV cache groups kept whole beside the compressed one (layer-selective compression;
    empty otherwise)."""
    from cords_vllm.integration.kv_groups import is_compressed

    if not any(is_compressed(spec) for spec in specs):
        return []
    return [i for i, spec in enumerate(specs) if not is_compressed(spec)]


def attention_manager(kv_cache_manager: Any, config: KVPolicyConfig | None = None) -> Any:
    """The scheduler's single-type manager of the compressed KV cache group (:func:`attention_group_index`)."""
    managers = kv_cache_manager.coordinator.single_type_managers
    return managers[attention_group_index([m.kv_cache_spec for m in managers], config)]


def check_layer_groups(groups: Sequence[Any], config: KVPolicyConfig) -> None:
    """Under layer-selective compression, check that vLLM put exactly the compressed layers in a group of their own
    (``groups``: vLLM's ``KVCacheGroupSpec`` list); raises ``NotImplementedError`` otherwise, before anything is
    compressed (a setting that merged the groups back would otherwise compress every layer)."""
    if config.compressed_layers is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cords_vllm.integration.kv_groups import is_compressed

    attention = [n for g in groups if isinstance(g.kv_cache_spec, FullAttentionSpec) for n in g.layer_names]
    if not config.layer_selective(len(attention)):
        return
    compressed = sorted(n for g in groups if is_compressed(g.kv_cache_spec) for n in g.layer_names)
    expected = sorted(n for n in attention if decoder_layer_index(n) < config.compressed_layers)
    if compressed != expected:
        kinds = ", ".join(f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)}" for g in groups)
        raise NotImplementedError(
            f"--kv-policy {config.policy}: kv_policy_config key 'compressed_layers' = {config.compressed_layers} "
            f"needs the compressed layers in a KV cache group of their own, but vLLM laid out [{kinds}] "
            "(--disable-hybrid-kv-cache-manager or a KV connector merges groups); leave compressed_layers out")
