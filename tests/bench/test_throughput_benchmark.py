"""``benchmarks/throughput.py`` end to end at a tiny size: the cells run on the real engine, round after round,
and the tables, the paired speed-ups and the JSON are written (timings mean nothing here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import load_benchmark

pytestmark = pytest.mark.engine


def test_rounds_of_every_cell_with_speedups_paired_by_round(tmp_path: Path, capsys) -> None:
    script = load_benchmark("throughput")
    assert script.main(["--requests", "2", "--frames", "16", "--size", "112", "--budget", "64",
                        "--chunk", "64", "--policies", "none", "cords", "--repeats", "2", "--no-plots",
                        "--no-prefix-caching", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["repeats"] == 2 and payload["baseline"] == "none"
    assert payload["engine"]["prefix_caching"] is False and payload["engine"]["block_size"] == 32
    assert [[r["label"] for r in round_] for round_ in payload["rounds"]] == [["none", "cords"]] * 2
    cords = next(r for r in payload["rounds"][0] if r["label"] == "cords")
    assert cords["compressions"] > 0  # the policy really compressed on the engine
    paired = {r["label"]: r for r in payload["paired"]}
    assert paired["none"]["speedups"] == [1.0, 1.0]
    walls = [{r["label"]: r["wall_s"] for r in round_} for round_ in payload["rounds"]]
    assert paired["cords"]["speedups"] == pytest.approx([w["none"] / w["cords"] for w in walls])
    # the representative run of each cell is one of its rounds' runs
    for result in payload["results"]:
        assert result["summary"]["wall_s"] in [w[result["label"]] for w in walls]
    out = capsys.readouterr().out
    assert "against none, round by round (2 rounds" in out and "| cords |" in out


def test_repeats_are_checked_before_any_engine_starts(capsys) -> None:
    script = load_benchmark("throughput")
    for argv, message in ((["--repeats", "0"], "--repeats must be >= 1"),
                          (["--repeats", "2", "--mode", "http"], "--repeats runs the offline cells"),
                          (["--policies", "none", "none"], "names a cell twice"),
                          (["--policies", "none", "cords", "--baseline", "evs"], "'evs' is not one of the cells"),
                          (["--mode", "http", "--baseline", "none"], "set up offline cells"),
                          (["--mode", "http", "--no-prefix-caching"], "set up offline cells")):
        with pytest.raises(SystemExit):
            script.main(argv)
        assert message in capsys.readouterr().err
