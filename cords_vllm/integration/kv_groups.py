"""Layer-selective compression in vLLM: the compressed layers get a KV cache group of their own.

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
checks the groups it gets (:func:`~cords_vllm.integration.engine_facts.check_layer_groups`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

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
