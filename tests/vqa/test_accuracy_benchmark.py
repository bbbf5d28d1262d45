"""``benchmarks/accuracy.py`` end to end on a handful of questions: cells, controls, coverage, plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import load_benchmark

pytestmark = pytest.mark.engine


# In -m slow (make test-slow): a benchmark's own check, kept out of the default suite to hold it under 20 minutes.
@pytest.mark.slow
def test_accuracy_benchmark_reports_cells_controls_and_plots(tmp_path: Path) -> None:
    script = load_benchmark("accuracy")
    rc = script.main(["--families", "colour", "order", "--per-family", "3", "--fractions", "0.25",
                      "--policies", "cords", "recency:recent=0", "--granularity", "token", "--chunk", "64",
                      "--out", str(tmp_path)])
    assert rc == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    runs = {(r["label"], r["fraction"]): r for r in payload["runs"]}
    assert set(runs) == {("none", None), ("cords", 0.25), ("recency:recent=0", 0.25)}
    assert payload["split"] == "heldout"  # the reported questions; tuning runs take --split monitor
    assert runs[("cords", 0.25)]["config"]["granularity"] == "token"
    assert runs[("recency:recent=0", 0.25)]["config"]["recent"] == 0
    full = runs[("none", None)]
    assert full["report"]["overall"] >= 5 / 6  # the shipped model: 99.5% held out
    # 64 frames = 512 video tokens; at 1/4 the request holds the 128-token budget plus the last 64-token chunk
    assert full["effective_video_tokens"] == 512 + 2  # the video's tokens and its two vision markers
    assert runs[("cords", 0.25)]["effective_video_tokens"] < 512 / 2
    controls = payload["controls"]
    assert controls["oracle"]["overall"] == controls["full_same_examples"]["overall"]
    assert controls["blanked"]["overall"] < controls["full_same_examples"]["overall"]
    assert set(payload["coverage_max_gap_vs_infinipot_v"]) == {"joint", "k", "v"}
    (cell,) = payload["cords_vs_best_other"]  # cords against the best other policy of its cell, on the same questions
    assert cell["best_other"] == "recency:recent=0" and cell["paired"]["n"] == 6
    assert cell["interval"][0] <= cell["accuracy"] <= cell["interval"][1]
    for name in ("accuracy_vs_budget.png", "accuracy_by_family.png", "coverage_cdf.png"):
        assert (tmp_path / name).stat().st_size > 10_000


# In -m slow (make test-slow): keeps the default suite under 20 minutes; frames served as images stay in the default
# suite through tests/engine/test_server_images.py.
@pytest.mark.slow
@pytest.mark.parametrize("equal", ["frames", "kv"])
def test_accuracy_benchmark_compares_frames_as_images_with_the_video(tmp_path: Path, capsys, equal: str) -> None:
    script = load_benchmark("accuracy")
    rc = script.main(["--families", "colour", "static", "--per-family", "2", "--fractions", "0.25",
                      "--policies", "cords", "--inputs", "video", "images", "--equal", equal, "--no-controls",
                      "--split", "monitor", "--out", str(tmp_path)])
    assert rc == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["split"] == "monitor"
    runs = {(r["label"], r["fraction"], r["inputs"]): r for r in payload["runs"]}
    assert set(runs) == {(label, fraction, inputs) for label, fraction in (("none", None), ("cords", 0.25))
                         for inputs in ("video", "images")}
    # 64 frames as 64 images: 16 tokens and two vision markers each, all of them candidates
    assert runs[("none", None, "images")]["effective_video_tokens"] == 64 * 18
    video_candidates = 32 * 16 + 2  # 32 two-frame patches of 16 tokens, and the video's two markers
    if equal == "frames":  # each shape keeps a quarter of its own tokens
        assert runs[("cords", 0.25, "images")]["budget"] == round(0.25 * 64 * 18)
    else:  # both hold the video's quarter
        assert runs[("cords", 0.25, "images")]["budget"] == round(0.25 * video_candidates)
    assert runs[("cords", 0.25, "video")]["budget"] == round(0.25 * video_candidates)
    assert runs[("cords", 0.25, "images")]["effective_video_tokens"] < 64 * 18 / 2
    assert runs[("none", None, "images")]["report"]["overall"] == runs[("none", None, "video")]["report"]["overall"]
    assert "| cords |" in capsys.readouterr().out.split("video vs images")[1]
    # the same questions in both shapes, compared question by question
    assert all(len(r["predictions"]) == payload["examples"] for r in payload["runs"])
    rows = {(row["label"], row["fraction"]): row for row in payload["inputs_comparison"]}
    assert set(rows) == {("none", None), ("cords", 0.25)}
    for (label, fraction), row in rows.items():
        video, images = (runs[(label, fraction, i)] for i in ("video", "images"))
        assert row["equal"] == equal and row["budget"] == {"video": video["budget"], "images": images["budget"]}
        assert row["accuracy"] == {"video": video["report"]["overall"], "images": images["report"]["overall"]}
        test = row["mcnemar"]
        assert test["n"] == payload["examples"]
        assert (test["second_only"] - test["first_only"]) == round(
            payload["examples"] * (images["report"]["overall"] - video["report"]["overall"]))
        assert 0.0 < test["p_value"] <= 1.0
    for name in ("accuracy_vs_budget.png", "images/accuracy_vs_budget.png", "inputs_comparison.png"):
        assert (tmp_path / name).stat().st_size > 10_000
