"""Layer-selective compression: which attention layers are compressed, and the KV cache groups that implies.

The paper compresses only the lower layers ("bottom 25%": layers 0-6 of Qwen2-VL-7B's 28) and keeps the upper
layers whole: late layers carry task-conditioned features that are sensitive to pruning, and an early layer's
loss cascades through every layer above it (paper, "Layer-selective compression and cascade reuse" and the
layer-scope sweep). ``compressed_layers: c`` in the policy's configuration compresses attention layers
``0 .. c-1``; layers ``c ..`` keep every token.

In vLLM one request has one block row per *KV cache group*, and all layers of a group share it, so the
compressed layers and the whole layers must be different groups sharing the pool. vLLM groups layers of
different KV cache types with equal layer counts per group (``_get_kv_cache_groups_uniform_page_size``): the
smaller type's count is the group size, unless the larger is under 1.5 times it, when the larger count is, and a
type's layers are split round-robin into ``ceil(count / size)`` groups, the last padded. Each block of the shared
pool then holds one page of ``group_size`` layers. :func:`kv_cache_layout` forecasts that layout (checked against
vLLM's own function in the tests); :func:`scope_problem` refuses a ``c`` that would split the compressed layers
over several groups (the plugin compresses one group: ``c`` must stay below 0.6 of the layers).

Pure integers: no torch, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from cords_vllm.utils import cdiv

#: vLLM's rule (``_get_kv_cache_groups_uniform_page_size``): the larger type's layer count sets the group size
#: when it is under this many times the smaller one.
_VLLM_PAD_RATIO = 1.5


@dataclass(frozen=True)
class KVCacheLayout:
    """How vLLM lays out the KV cache of ``compressed`` lower layers beside ``whole`` upper layers.

    Attributes
    ----------
    group_size:
        Layers per KV cache group (one page of each per pool block).
    compressed_groups, whole_groups:
        Groups of each kind.
    padding_layers:
        Padding layers vLLM adds to fill the last group of each kind (memory they waste, per block).
    """

    compressed: int
    whole: int
    group_size: int
    compressed_groups: int
    whole_groups: int
    padding_layers: int

    def layer_tokens(self, held: int, tokens: int) -> int:
        """Layer-token pages one request uses, padding included: ``held`` tokens in each compressed group and all
        ``tokens`` in each whole group (multiply by the bytes per token per layer for bytes)."""
        return self.group_size * (self.compressed_groups * held + self.whole_groups * tokens)


def kv_cache_layout(compressed: int, num_layers: int) -> KVCacheLayout:
    """vLLM's KV cache groups for ``compressed`` of ``num_layers`` attention layers (``0 < compressed <=
    num_layers``; all compressed is one group)."""
    if not 0 < compressed <= num_layers:
        raise ValueError(f"compressed layers must be in 1..{num_layers}, got {compressed}")
    whole = num_layers - compressed
    if whole == 0:
        return KVCacheLayout(compressed, 0, compressed, 1, 0, 0)
    small, large = min(compressed, whole), max(compressed, whole)
    size = large if large < small * _VLLM_PAD_RATIO else small
    c_groups, w_groups = cdiv(compressed, size), cdiv(whole, size)
    padding = (c_groups + w_groups) * size - num_layers
    return KVCacheLayout(compressed, whole, size, c_groups, w_groups, padding)


def scope_problem(compressed: int, num_layers: int) -> str | None:
    """Why ``compressed_layers: compressed`` cannot run on a model with ``num_layers`` attention layers, or
    ``None`` when it can."""
    if compressed > num_layers:
        return f"the model has {num_layers} attention layers"
    layout = kv_cache_layout(compressed, num_layers)
    if layout.compressed_groups > 1:
        most = max(c for c in range(1, num_layers) if kv_cache_layout(c, num_layers).compressed_groups == 1)
        return (f"vLLM would split {compressed} compressed layers beside {layout.whole} whole ones into "
                f"{layout.compressed_groups} KV cache groups, and the policy compresses one group: compress at most "
                f"{most} of the {num_layers} layers, or all of them (leave compressed_layers out)")
    return None


def describe(compressed: int, num_layers: int) -> str:
    """The start-up line's words for a layer scope."""
    if compressed >= num_layers:
        return f"all {num_layers} attention layers compressed"
    layout = kv_cache_layout(compressed, num_layers)
    padding = f", {layout.padding_layers} padding layers" if layout.padding_layers else ""
    return (f"attention layers 0..{compressed - 1} compressed, {compressed}..{num_layers - 1} whole (KV cache groups "
            f"of {layout.group_size} layers: {layout.compressed_groups} compressed, {layout.whole_groups} whole"
            f"{padding})")
