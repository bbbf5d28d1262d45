"""The per-stage anchor rule of pipeline parallelism (pure): every layer follows an anchor on its own stage, the
configured anchors stay, and the rule is the one ``KVPolicyConfig.anchor_of`` applies to the returned anchors."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from cords_vllm.compress.pipeline import (
    PipelineAnchorError,
    attention_ordinals,
    attention_stages,
    pipeline_anchors,
    stage_anchor_of,
)
from cords_vllm.config import KVPolicyConfig
from cords_vllm.integration.startup.checks import pipeline_change


def _split(num_layers: int, sizes: tuple[int, ...]) -> list[range]:
    starts = list(itertools.accumulate((0, *sizes)))
    assert starts[-1] == num_layers
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def _anchor_maps(anchors: tuple[int, ...] | None, stages: list[range]) -> list[tuple[int, ...]]:
    total = stages[-1].stop
    effective = dataclasses.replace(KVPolicyConfig(), anchors=pipeline_anchors(anchors, stages))
    return [stage_anchor_of(lambda layer: effective.anchor_of(layer, total), stage) for stage in stages]


@pytest.mark.parametrize(("anchors", "sizes", "expected"), [
    ((0,), (2, 2), (0, 2)),          # the default: the second stage's first layer selects for it
    ((1,), (2, 2), (1, 2)),          # stage 0's layer 0 keeps following layer 1 (below the lowest anchor)
    ((3,), (2, 2), (0, 2, 3)),       # one late anchor: each stage gets its first layer
    ((0, 2), (2, 2), (0, 2)),        # already one anchor per stage: unchanged
    ((0,), (4,), (0,)),              # one stage: unchanged
    ((0, 5), (3, 3, 2), (0, 3, 5, 6)),
    (None, (2, 2), None),            # "all": every layer selects for itself
])
def test_pipeline_anchors(anchors, sizes, expected):
    assert pipeline_anchors(anchors, _split(sum(sizes), sizes)) == expected


def test_every_layer_follows_an_anchor_on_its_own_stage_for_every_layout():
    """Exhaustive over 1..7 layers, every split into 1..4 stages and every anchor set: the returned anchors keep the
    configured ones, the model-wide rule never leaves a stage, and one stage changes nothing."""
    checked = 0
    for layers in range(1, 8):
        for stages_count in range(1, min(layers, 4) + 1):
            for cuts in itertools.combinations(range(1, layers), stages_count - 1):
                sizes = tuple(b - a for a, b in itertools.pairwise((0, *cuts, layers)))
                stages = _split(layers, sizes)
                for k in range(1, layers + 1):
                    for anchors in itertools.combinations(range(layers), k):
                        effective = pipeline_anchors(anchors, stages)
                        assert set(anchors) <= set(effective)
                        assert all(any(a in s for a in effective) for s in stages)
                        maps = _anchor_maps(anchors, stages)  # raises if a layer's anchor is off its stage
                        assert [len(m) for m in maps] == list(sizes)
                        if stages_count == 1:
                            assert effective == anchors
                        checked += 1
    assert checked > 1000


def test_a_follower_whose_anchor_is_on_another_stage_is_refused():
    """The negative control: the configured anchors alone put layer 2's and 3's anchor on stage 0."""
    stages = _split(4, (2, 2))
    config = dataclasses.replace(KVPolicyConfig(), anchors=(0,))
    with pytest.raises(PipelineAnchorError, match="layer 2 follows anchor 0"):
        stage_anchor_of(lambda layer: config.anchor_of(layer, 4), stages[1])
    assert stage_anchor_of(lambda layer: config.anchor_of(layer, 4), stages[0]) == (0, 0)


def test_positions_are_local_to_the_stage():
    stages = _split(6, (3, 3))
    # stage 0: layers 0..2 follow layer 1 (layer 0 is below the lowest anchor); stage 1: 3 -> 3, 4 -> 4, 5 -> 4
    assert _anchor_maps((1, 4), stages) == [(1, 1, 1), (0, 1, 1)]


def test_hybrid_stages_count_attention_layers_only():
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
    assert attention_stages([(0, 4), (4, 8)], types) == [range(0, 1), range(1, 2)]
    assert attention_stages([(0, 2), (2, 8)], types) == [range(0, 0), range(0, 2)]
    assert attention_stages([(0, 3), (3, 5)]) == [range(0, 3), range(3, 5)]
    assert attention_ordinals([3, 7], types) == [0, 1]
    assert attention_ordinals([2, 3]) == [2, 3]
    assert pipeline_anchors((0,), [range(0, 0), range(0, 2)]) == (0,)  # an empty stage adds nothing


def test_the_start_up_line_names_the_change():
    stages = _split(4, (2, 2))
    line = pipeline_change(KVPolicyConfig.parse("cords", {"anchors": [0]}), stages)
    assert line is not None and "anchors [0] -> [0, 2]" in line and "0..1, 2..3" in line
    assert pipeline_change(KVPolicyConfig.parse("cords", {"anchors": [0, 2]}), stages) is None
    assert pipeline_change(KVPolicyConfig.parse("cords", {"anchors": [0]}), [range(0, 4)]) is None
    assert pipeline_change(KVPolicyConfig.parse("cords", {"anchors": "all"}), stages) is None
