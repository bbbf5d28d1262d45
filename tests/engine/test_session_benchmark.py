"""``benchmarks/session_length.py`` end to end at small size: none stops at the pool, cords runs past it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import load_benchmark

pytestmark = pytest.mark.engine


def test_session_length_benchmark_reports_flat_blocks_past_the_pool(tmp_path: Path, capsys) -> None:
    module = load_benchmark("session_length")
    assert module.main(["--pools", "3", "--pool-blocks", "24", "--budget", "192", "--max-text-tokens", "128",
                        "--out", str(tmp_path)]) == 0
    summaries = {s["label"]: s for s in json.loads((tmp_path / "results.json").read_text())["summaries"]}
    assert summaries["none"]["stream_in_pools"] < 1 and "max-model-len" in summaries["none"]["stopped"]
    assert summaries["cords"]["stream_in_pools"] >= 3 and summaries["cords"]["stopped"] is None
    assert summaries["cords"]["peak_held_blocks"] < 24
    assert "| cords |" in capsys.readouterr().out
    for name in ("session_blocks.png", "session_push_time.png"):
        assert (tmp_path / name).stat().st_size > 10_000
