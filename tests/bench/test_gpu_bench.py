"""``benchmarks/gpu_bench.py`` (``scripts/gpu-bench.sh``) on the CPU build: the one-minute subset on every run, the
whole CPU plan in the slow suite. Each serves a weightless, scaled-down 7B directory with ``--load-format dummy``; on
two shared cores the timings mean nothing, so what is checked is that every step runs on the real server and the
JSON and the table hold what the GPU run will fill in (the targets are a GPU's, never judged here)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.scripts import ROOT, load_benchmark


@pytest.mark.parametrize(("argv", "words"), [
    (["--quick", "--policies", "vidcom2+cords"], "unknown pruning 'vidcom2'"),
    (["--quick", "--levels", "4", "2"], "--levels must be increasing"),
    (["--quick", "--window", "1"], "at least two pushes"),
    (["--quick", "--plan", "cpu"], "--quick is a plan of its own"),
    (["--plan", "gpu"], "needs CUDA"),
])
def test_bad_plans_are_refused_before_any_server_starts(argv, words, tmp_path, capsys) -> None:
    script = load_benchmark("gpu_bench")
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path), *argv])
    assert words in capsys.readouterr().err
    assert not (tmp_path / "models").exists()  # nothing written, no server started


def test_the_shell_entry_checks_the_plan_first() -> None:
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-bench.sh"), "--cpu", "--levels", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--levels must be increasing counts >= 1" in run.stderr


@pytest.mark.server
def test_the_quick_subset_serves_the_7b_path_and_writes_the_json(tmp_path: Path, capsys) -> None:
    script = load_benchmark("gpu_bench")
    assert script.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "gpu_bench.json").read_text())
    cell = payload["cells"]["cords"]
    assert cell["error"] is None and "--load-format" in cell["flags"] and cell["shape"] == "qwen2-vl-7b"
    config = json.loads((tmp_path / "models" / "qwen2-vl-7b" / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 2  # the scaled-down directory, no weights beside it
    assert not list((tmp_path / "models" / "qwen2-vl-7b").glob("*.safetensors"))
    assert cell["oneshot"]["requests_per_s"] > 0 and cell["oneshot"]["video_tokens"] == 512
    levels = cell["ramp"]["levels"]
    assert [lv["streams"] for lv in levels] == [1] and levels[0]["pushes"] > 0
    assert levels[0]["compressions"] > 0 and levels[0]["compress_s"] > 0  # pre-rolled to its budget: compressing
    assert levels[0]["chat_gaps"] > 0 and levels[0]["itl_p99_ms"] >= levels[0]["itl_p50_ms"] > 0
    assert set(levels[0]["cpu_cores"]) == {"api_server", "engine", "client"}
    assert {r["kernels"] for r in payload["step"]["rows"]} == {"torch"} and payload["step"]["status"] == 0
    assert [t["pass"] for t in payload["targets"]] == [None, None, None]  # a GPU's targets: not judged on CPU
    table = (tmp_path / "gpu_bench.md").read_text()
    assert "| cords |" in table and table in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.server
def test_the_cpu_plan_runs_every_cell_and_names_what_ran_out(tmp_path: Path) -> None:
    script = load_benchmark("gpu_bench")
    assert script.main(["--plan", "cpu", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "gpu_bench.json").read_text())
    cells = payload["cells"]
    assert list(cells) == ["cords", "none", "evs+cords"] and all(c["error"] is None for c in cells.values())
    assert cells["evs+cords"]["shape"] == "qwen2.5-vl-7b" and cells["evs+cords"]["ramp"] is None
    assert all(c["oneshot"]["requests_per_s"] > 0 for c in cells.values())
    none = cells["none"]["ramp"]
    # none admits a --max-model-len footprint per stream: the pool refuses a level past its capacity
    assert none["capacity"]["max_streams"] < 4 and none["levels"][-1]["streams"] == 4
    assert none["limit"].startswith("KV pool") and none["levels"][-1]["refused"] > 0
    assert none["held"] is not None and none["held"] <= none["capacity"]["max_streams"]
    cords = cells["cords"]["ramp"]
    assert cords["capacity"]["max_streams"] >= 4 and all(lv["refused"] == 0 for lv in cords["levels"])
    assert any(lv["compressions"] > 0 for lv in cords["levels"])
    assert all(lv["compressions"] == 0 for lv in none["levels"])
    delta = payload["itl_delta"]["32"]  # beside as many compressing streams (cords) as not (none)
    assert delta["streams"] == none["held"] or delta["streams"] in [lv["streams"] for lv in none["levels"]]
