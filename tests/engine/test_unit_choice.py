"""``granularity: "auto"`` (the default) chooses each compression's unit by how many units it keeps
(:mod:`cords_vllm.compress.unit_choice`), in the real engine.

The video has 24 frames of 64 tokens and the budget keeps 128 to 192 video tokens per compression. With
``min_units`` 1, ``auto`` must keep exactly what ``frame`` granularity keeps; with ``min_units`` above any kept
count, exactly what ``token`` granularity keeps; with its default (32) it selects runs of 4 tokens and keeps
something else again. The fixed units disagree on this video (checked), so a rule that ignored the count, or a
worker that ignored the rule, fails one of the comparisons. Its exactness against HF is in ``test_exactness``.
"""

from __future__ import annotations

from cords_vllm.compress.unit_choice import DEFAULT_MIN_UNITS, Unit, compression_unit
from tests.engine.conftest import VIDEO_PROMPT, run_engine, video


def _kept(run) -> list[list[list[int]]]:
    return [[ids.tolist() for ids in event.kept_logical] for event in run.events]


def test_auto_keeps_what_the_unit_its_rule_names_keeps(tiny_model):
    prompts = [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(48)}}]
    common = {"max_tokens": 2, "budget": 256, "slack": 64}
    configs = {"token": {"granularity": "token"}, "frame": {"granularity": "frame"}, "auto": {},
               "auto, min_units 1": {"min_units": 1}, "auto, min_units 10000": {"min_units": 10_000}}
    runs = {name: run_engine(tiny_model, prompts, "cords", **common, **config) for name, config in configs.items()}
    assert runs["token"].compressions >= 2
    assert compression_unit("auto", 128, 64, DEFAULT_MIN_UNITS) == Unit("block", 4)  # this video's default
    kept = {name: _kept(run) for name, run in runs.items()}
    assert kept["token"] != kept["frame"]  # the fixed units disagree on this video
    assert kept["auto, min_units 1"] == kept["frame"]
    assert kept["auto, min_units 10000"] == kept["token"]
    assert kept["auto"] not in (kept["token"], kept["frame"])
    for run in runs.values():
        assert run.free_blocks_after == run.free_blocks_before
