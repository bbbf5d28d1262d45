"""Per-layer, per-KV-head variants of the attention-scored baselines (and of ``cords``), as their papers select.

The streaming proxies ``snapkv``, ``infinipot`` and ``streammem`` make one selection, on anchor layer 0, jointly over
the KV heads, and every layer reuses it (the cascade ``cords`` is built around). Their papers select **in every
layer, for each KV head, from that layer's own attention**. Each variant here is the same rule with those engine
settings as its defaults (:attr:`~cords_vllm.selection.base.Selector.engine_defaults`), so it runs in the engine
like every policy and a user's ``kv_policy_config`` can still override them:

* ``anchors: "all"``: every compressed layer runs the selector on its own keys, values and observation queries
  (the engine captures the observation window's queries per anchor layer);
* ``per_head: true``: each KV head keeps its own tokens (the same number per head, so the paged layout holds);
* ``snapkv_layerwise`` also selects token by token (``granularity: "token"``), so its pooling runs at every unit
  as SnapKV's does (``auto`` would pick frame or block units for long videos, where pooling is skipped).

``cords_layerwise`` is ``cords`` under the same settings, the like-for-like comparison. What the variants still
leave out of their papers, and why (each proxy's own docstring has the details): InfiniPot's novelty under
compression (NuC) scores how hard the model found a token to predict, which video tokens (embeddings, never
sampled) do not have; StreamMem's proxy query is the template text before the clip at its own place (the engine
cannot run the template again after each clip inside a step), and its merged per-frame prototypes (the engine
keeps original tokens at their own positions only). The cost of selecting in every layer is what the fidelity and
throughput benchmarks report beside accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from cords_vllm.selection.cords import CoRDSSelector
from cords_vllm.selection.infinipot import InfiniPotSelector
from cords_vllm.selection.registry import register_selector
from cords_vllm.selection.snapkv import SnapKVSelector
from cords_vllm.selection.streammem import StreamMemSelector

#: Every layer selects from its own attention, each KV head on its own.
LAYERWISE: MappingProxyType[str, Any] = MappingProxyType({"anchors": "all", "per_head": True})


def variant_doc(summary: str, base: type) -> str:
    """A variant's docstring: what it changes, then its base policy's (the rule, the paper, the parameters)."""
    return f"{summary}\n\n    The rule, as {base.__name__}:\n\n    {(base.__doc__ or '').strip()}"


@register_selector("snapkv_layerwise")
@dataclass(frozen=True)
class SnapKVLayerwiseSelector(SnapKVSelector):
    __doc__ = variant_doc("SnapKV in every layer, per KV head, token by token (its pooling at every unit).",
                          SnapKVSelector)

    engine_defaults: ClassVar[MappingProxyType[str, Any]] = MappingProxyType({**LAYERWISE, "granularity": "token"})


@register_selector("infinipot_layerwise")
@dataclass(frozen=True)
class InfiniPotLayerwiseSelector(InfiniPotSelector):
    __doc__ = variant_doc("InfiniPot's catalyst attention in every layer, per KV head.", InfiniPotSelector)

    engine_defaults: ClassVar[MappingProxyType[str, Any]] = LAYERWISE


@register_selector("streammem_layerwise")
@dataclass(frozen=True)
class StreamMemLayerwiseSelector(StreamMemSelector):
    __doc__ = variant_doc("StreamMem's proxy-query attention in every layer, per KV head.", StreamMemSelector)

    engine_defaults: ClassVar[MappingProxyType[str, Any]] = LAYERWISE


@register_selector("cords_layerwise")
@dataclass(frozen=True)
class CoRDSLayerwiseSelector(CoRDSSelector):
    __doc__ = variant_doc("CoRDS in every layer, per KV head: the like-for-like comparison with the other "
                          "``*_layerwise`` policies.", CoRDSSelector)

    engine_defaults: ClassVar[MappingProxyType[str, Any]] = LAYERWISE
