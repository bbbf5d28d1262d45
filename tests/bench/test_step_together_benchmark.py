"""``benchmarks/step_together.py`` end to end at its small shape, with both implementations: a step's compressions
together and one after another keep the same tokens and leave the same caches, and the table and JSON are written
(timings mean nothing here)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.scripts import load_benchmark


def test_the_benchmark_compares_together_with_alone(tmp_path: Path, capsys) -> None:
    module = load_benchmark("step_together")
    assert module.main(["--quick", "--requests", "2", "--repeats", "1", "--kernels", "triton", "torch",
                        "--out", str(tmp_path)]) == 0  # the kernels under Triton's interpreter without a GPU
    rows = json.loads((tmp_path / "step_together.json").read_text())["rows"]
    assert [(r["kernels"], r["requests"]) for r in rows] == [("triton", 2), ("torch", 2)]
    assert all(r["same"] for r in rows)
    assert all(r["alone_ms"] > 0 and r["together_ms"] > 0 for r in rows)
    assert "| torch | 2 |" in capsys.readouterr().out
