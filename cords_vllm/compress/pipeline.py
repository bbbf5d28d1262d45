"""Anchors under pipeline parallelism: every stage selects on its own layers (pure, integers only).

Under pipeline parallelism of degree ``P`` each stage holds a contiguous range of the model's attention layers
(vLLM's ``get_pp_indices``), while all stages share the block ids: the scheduler's plan is one, every stage
carries it out on its own layers. A follower layer reuses its anchor's kept positions, so its anchor must be on
its own stage: a stage cannot read another stage's keys, and vLLM has no channel to send the indices along (stages
exchange hidden states during the forward, a compression runs before it; layers below the lowest anchor would even
need a later stage's).

The rule (:func:`pipeline_anchors`): the configured anchors stay, and the first layer of every stage after the
first becomes an anchor too, as does the first stage's first layer when that stage holds no configured anchor.
Every layer then follows the nearest anchor at or below it (the one rule of ``KVPolicyConfig.anchor_of``), and
that anchor is always on the layer's own stage (:func:`stage_anchor_of` checks it). So a pipeline-parallel engine
selects exactly as one stage would with the anchors :func:`pipeline_anchors` returns: its kept tokens and answers
equal a ``P = 1`` engine configured with those anchors.

Why different stages may keep different tokens: every anchor keeps exactly the plan's ``num_keep`` tokens per
request (all protected tokens plus the same number of candidates), in row order, into the same kept blocks, so
each layer of each stage fills the same slots with its own choice, exactly as layers with different anchors do on
one stage. What the scheduler and the attention view read (counts, blocks, holes) is the same on every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: The attention kind whose layers hold a per-token KV cache, in a hybrid model's ``layer_types``.
FULL_ATTENTION = "full_attention"


class PipelineAnchorError(ValueError):
    """A layer's anchor lies on another pipeline stage, or a stage holds other layers than the layout says."""


def attention_stages(decoder_stages: Sequence[tuple[int, int]], layer_types: Sequence[str] | None = None
                     ) -> list[range]:
    """Each stage's attention layers, as ranges of attention-layer indices (what ``anchors`` index).

    ``decoder_stages``: each stage's ``[start, end)`` decoder layers, in stage order, covering the model.
    ``layer_types``: a hybrid model's per-decoder-layer kinds (only :data:`FULL_ATTENTION` layers hold per-token
    KV and are counted); ``None``: every decoder layer is an attention layer.
    """
    stages, first = [], 0
    for start, end in decoder_stages:
        count = end - start if layer_types is None else sum(k == FULL_ATTENTION for k in layer_types[start:end])
        stages.append(range(first, first + count))
        first += count
    return stages


def attention_ordinals(decoder_layers: Sequence[int], layer_types: Sequence[str] | None = None) -> list[int]:
    """The attention-layer index of each of ``decoder_layers`` (decoder layer indices of attention layers): itself,
    or in a hybrid model (``layer_types``) the number of :data:`FULL_ATTENTION` layers before it."""
    if layer_types is None:
        return list(decoder_layers)
    return [sum(k == FULL_ATTENTION for k in layer_types[:d]) for d in decoder_layers]


def pipeline_anchors(anchors: tuple[int, ...] | None, stages: Sequence[range]) -> tuple[int, ...] | None:
    """The anchors a pipeline-parallel engine selects on (sorted), given the configured ``anchors`` and each
    stage's attention layers (``None``: every layer is its own anchor, unchanged).

    The configured anchors, the first layer of every non-empty stage after the first, and the first stage's first
    layer when it holds no configured anchor. With one stage: the configured anchors.
    """
    if anchors is None:
        return None
    out = set(anchors)
    for index, stage in enumerate(stages):
        if len(stage) and (index > 0 or not any(a in stage for a in anchors)):
            out.add(stage.start)
    return tuple(sorted(out))


def stage_anchor_of(anchor_of: Callable[[int], int], stage: range) -> tuple[int, ...]:
    """For each layer of ``stage``, in order, the position within the stage of the anchor it follows.

    ``anchor_of``: the model-wide rule, layer index -> anchor index (``KVPolicyConfig.anchor_of`` on the
    :func:`pipeline_anchors`). Raises :class:`PipelineAnchorError` when a layer's anchor is on another stage.
    """
    out = []
    for layer in stage:
        anchor = anchor_of(layer)
        if anchor not in stage:
            raise PipelineAnchorError(
                f"layer {layer} follows anchor {anchor}, which is not on its pipeline stage (layers {stage.start}.."
                f"{stage.stop - 1}); a stage can only reuse the selection of its own layers")
        out.append(anchor - stage.start)
    return tuple(out)
