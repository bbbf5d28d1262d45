"""Video pruning cells of the benchmarks: names, budgets and the engine settings they turn into."""

from __future__ import annotations

import pytest

from cords_vllm.lab.bench import pruning
from cords_vllm.lab.bench.accuracy import budget_cells


def test_pruning_alone_keeps_the_budgets_share_and_runs_no_policy():
    spec = pruning.parse("evs", {"granularity": "token"})
    assert spec.policy == "none" and pruning.budgeted(spec)
    config, engine = pruning.split(spec, 128, 512)
    assert config == {} and engine == {"video_pruning_rate": 0.75, "video_pruning_method": "evs"}
    assert pruning.split(pruning.parse("vidcom2", {}), 64, 512)[1]["video_pruning_method"] == "vidcom2"


def test_pruning_before_a_policy_runs_at_its_rate_and_the_policy_keeps_the_budget():
    spec = pruning.parse("evs+cords:granularity=token,pruning_rate=0.25", {})
    assert spec.policy == "cords" and spec.label == "evs+cords:granularity=token,pruning_rate=0.25"
    config, engine = pruning.split(spec, 64, 512)
    assert config == {"granularity": "token"}
    assert engine == {"video_pruning_rate": 0.25, "video_pruning_method": "evs"}
    assert pruning.split(pruning.parse("evs+cords", {}), 64, 512)[1]["video_pruning_rate"] == 0.5


def test_plain_policies_and_full_kv_are_unchanged():
    assert pruning.split(pruning.parse("cords:alpha=0.1", {}), 64, 512) == ({"alpha": 0.1}, {})
    assert not pruning.budgeted(pruning.parse("none", {}))
    cells = budget_cells(["cords", "evs", "none"], [0.5, 0.25], 512, 32)
    assert [(c[0].label, c[1], c[2]) for c in cells] == [
        ("none", None, None), ("cords", 0.5, 256), ("evs", 0.5, 256), ("cords", 0.25, 128), ("evs", 0.25, 128)]


@pytest.mark.parametrize("text, match", [("evs:pruning_rate=0.5", "no settings"), ("evs+none", "KV policy"),
                                         ("evs+cords:pruning_rate=1.0", "outside"),
                                         ("cords:pruning_rate=0.5", "without a pruning method")])
def test_bad_cells_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        pruning.split(pruning.parse(text, {}), 64, 512)


def test_a_benchmark_budget_default_reaches_pruning_alone():
    spec = pruning.parse("evs", {"budget": 1024})
    assert pruning.split(spec, None, 4096) == ({}, {"video_pruning_rate": 0.75, "video_pruning_method": "evs"})
    assert pruning.split(pruning.parse("evs+cords", {"budget": 1024}), None, 4096)[0] == {"budget": 1024}
