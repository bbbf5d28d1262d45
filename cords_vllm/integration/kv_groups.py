"""The KV cache groups of the engine vLLM built, and the compressed layers' group of their own.

One home for KV cache groups in the engine: which group a policy compresses (:func:`attention_group_index`,
:func:`attention_manager`), which full-attention groups are kept whole beside it (:func:`whole_group_indices`), the
check of the groups vLLM made (:func:`check_layer_groups`), and how layer-selective compression gets them.

vLLM gives every layer of one KV cache group the same block row, so keeping the upper layers whole while the
lower layers are compressed needs the two sets in different groups that share the block pool
(:mod:`cords_vllm.compress.layer_scope`). vLLM puts layers in different groups only when their ``KVCacheSpec``
types differ, and has no setting for it. The workers therefore give the compressed layers
:class:`CompressedAttentionSpec`, a ``FullAttentionSpec`` that refuses to share a group with any other spec
(:func:`mark_compressed_layers`, called from the workers' wrapper of ``GPUModelRunner.get_kv_cache_spec``);
everything else about the layers (page size, attention backend, block manager, found by walking the class's MRO)
stays full attention, so vLLM lays out the two kinds as it does a hybrid model's attention types. Only under
layer-selective compression: with every layer compressed the specs are vLLM's own.

The class says "not uniform with" and "cannot merge with" anything but its own kind on its own instances, so
vLLM's grouping separates the kinds in every process that unpickles the specs, with no registration to order
(``KVCacheSpecRegistry`` walks the MRO to ``FullAttentionSpec`` for its manager). vLLM asks the *first* layer's spec
whether the collection is uniform: layer 0 is always compressed, so the question reaches this class. The engine
checks the groups it gets (:func:`check_layer_groups`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec

from cords_vllm.config import KVPolicyConfig
from cords_vllm.integration.engine_facts import decoder_layer_index


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressedAttentionSpec(FullAttentionSpec):
    """Full attention whose layers the KV policy compresses, beside full-attention layers it keeps whole."""

    def is_uniform_with_collection(self, kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
        return all(isinstance(spec, CompressedAttentionSpec) for spec in kv_cache_specs.values())

    @classmethod
    def merge(cls, specs: list[Any]) -> CompressedAttentionSpec:
        # vLLM catches AssertionError (and ValueError) as "these specs cannot share a group"
        if not all(isinstance(spec, CompressedAttentionSpec) for spec in specs):
            raise AssertionError("compressed and whole attention layers cannot share a KV cache group")
        return super().merge(specs)


def mark_compressed_layers(specs: Mapping[str, KVCacheSpec], compressed: int) -> dict[str, KVCacheSpec]:
    """``specs`` (vLLM's layer name -> spec) with the full-attention layers below decoder layer ``compressed``
    given :class:`CompressedAttentionSpec` (same fields)."""
    out: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        if type(spec) is FullAttentionSpec and decoder_layer_index(name) < compressed:
            spec = CompressedAttentionSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
        out[name] = spec
    marked = sum(isinstance(s, CompressedAttentionSpec) for s in out.values())
    if marked != compressed:
        raise ValueError(f"compressed_layers = {compressed}, but {marked} of the model's attention layers below it "
                         "are plain full attention; layer-selective compression needs full-attention layers")
    return out


def full_attention_layers(specs: Mapping[str, KVCacheSpec]) -> int:
    """Full-attention layers among a worker's layer specs."""
    return sum(isinstance(spec, FullAttentionSpec) for spec in specs.values())


def is_compressed(spec: Any) -> bool:
    """Whether a KV cache group's spec is the compressed layers' (layer-selective compression)."""
    return isinstance(spec, CompressedAttentionSpec)


def attention_group_index(specs: Sequence[Any], config: KVPolicyConfig | None = None) -> int:
    """The index of the one KV cache group the policy compresses, among the engine's groups' ``specs``
    (``KVCacheSpec`` each, in vLLM's group order).

    A model has one full-attention group; a hybrid model (Qwen3.5: Gated DeltaNet layers) also has groups of
    fixed-size recurrent state (``MambaSpec``), which hold no per-token KV and are left alone. Under layer-selective
    compression the compressed layers' group (:class:`~cords_vllm.integration.kv_groups.CompressedAttentionSpec`)
    is the one, and full-attention groups beside it are kept whole (:func:`whole_group_indices`). Anything else (a
    second attention group: sliding-window, chunked-local or MLA layers beside full attention) is refused.
    """
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
