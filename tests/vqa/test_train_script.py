"""``benchmarks/train_vqa.py`` runs end to end (a few steps on tiny videos) and writes a complete record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import load_benchmark


def test_curriculum_and_weights_parse() -> None:
    script = load_benchmark("train_vqa")
    args = script.parse_args(["--curriculum", "colour@16,32:5", "--family-weights", "count=2"])
    stages = script.make_stages(args, script.make_families(args))
    assert stages[0].describe() == {"families": ["colour"], "frames": [16, 32], "steps": 5}
    assert [f.name for f in stages[1].families] == ["colour", "order", "count", "count", "static"]
    assert stages[1].steps is None
    lr = [script.lr_at(script.parse_args(["--steps", "100"]), s, 0.0) for s in (0, 29, 50, 99)]
    assert lr[0] < lr[1] and lr[1] > lr[2] > lr[3] > 0


def test_input_shapes_parse() -> None:
    script = load_benchmark("train_vqa")
    assert script.input_shapes(script.parse_args([])) == ["video"]
    assert script.input_shapes(script.parse_args(["--inputs", "video,images,images"])) == ["video", "images"]
    with pytest.raises(SystemExit, match="--inputs"):
        script.input_shapes(script.parse_args(["--inputs", "video,audio"]))


@pytest.mark.slow
def test_training_smoke(tmp_path: Path) -> None:
    script = load_benchmark("train_vqa")
    out = tmp_path / "run"
    script.main(["--steps", "3", "--frames", "8", "--size", "56", "--batch", "4", "--eval-every", "2",
                 "--monitor-per-family", "2", "--heldout-per-family", "2", "--vllm-per-family", "2",
                 "--test-per-family", "1", "--curriculum", "colour@8:1", "--inputs", "video,images",
                 "--stream-batch", "2", "--stream-size", "56", "--stream-clips", "2,4", "--stream-hard", "0.5",
                 "--stream-monitor", "4", "--stream-heldout", "8", "--output", str(out)])
    ckpt = out / "checkpoint"
    record = json.loads((ckpt / "training.json").read_text())
    assert record["training"]["steps"] == 3
    assert set(record["results"]["summary"]) == {"hf", "vllm"}
    assert "T8-images" in record["results"]["hf_heldout"]  # frames sent as images are scored too
    stream = record["results"]["hf_stream_heldout"]  # held-out stream accuracy, split by the hard case
    assert stream["examples"] == 8
    assert stream["latest_mark_asked"]["examples"] + stream["other_kind_newer"]["examples"] == 8
    assert record["data"]["stream"]["hard"] == 0.5 and record["data"]["stream"]["clips"] == [2, 4]
    assert record["results"]["vllm"]["test_split"]["per_family"] == 1
    assert (out / "checkpoint-fp32" / "model.safetensors").is_file()
    assert json.loads((ckpt / "config.json").read_text())["text_config"]["dtype"] == "bfloat16"
    text = (ckpt / "training.json").read_text()
    assert str(tmp_path) not in text  # no absolute paths of this machine in the record
