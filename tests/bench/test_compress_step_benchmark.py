"""``benchmarks/compress_step.py`` end to end at its small shape: both implementations, the same kept ids.

Without a GPU the kernels run under Triton's interpreter (``tests/conftest.py``), so the timings mean nothing; what is
checked is what a GPU run relies on: every case runs with both implementations, the kernel rows say whether they
kept the PyTorch path's tokens, and the JSON and the table are written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.scripts import load_benchmark

pytest.importorskip("triton")


def test_the_benchmark_compares_both_implementations_on_every_case(tmp_path: Path, capsys) -> None:
    module = load_benchmark("compress_step")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on CPU
    assert module.main(["--quick", "--device", device, "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "compress_step.json").read_text())
    rows = result["rows"]
    cases = {r["case"] for r in rows}
    assert len(cases) == 8 and len(rows) == 16
    assert "auto (the default), anchors [0]" in cases
    assert all(r["same_ids"] is True for r in rows if r["kernels"] == "triton")
    assert {r["path"] for r in rows if r["kernels"] == "triton"} == {"fused step"}  # every case: cords, either novelty
    assert {r["path"] for r in rows if r["kernels"] == "torch"} == {"PyTorch"}
    assert all(r["floor_ms"] > 0 and r["wall_ms"] > 0 for r in rows)
    # each kernel row ran the start-up warm-up for its region's server first; a GPU counts what compiled after it
    assert all(r["warmup_variants"] > 0 for r in rows if r["kernels"] == "triton")
    assert all(r["warmup_variants"] is None for r in rows if r["kernels"] == "torch")
    if device == "cpu":
        assert result["targets"] == []  # the targets are a GPU's; none is claimed on CPU
        assert all(r["compiled_after_warmup"] is None for r in rows)  # the interpreter compiles nothing
    else:
        assert all(r["compiled_after_warmup"] == 0 for r in rows if r["kernels"] == "triton")
    table = (tmp_path / "compress_step.md").read_text()
    assert "| frame, anchors [0] | triton | fused step |" in table and "| warm-up variants |" in table
    assert "same ids True" in capsys.readouterr().out


def test_the_device_time_is_split_by_kernel_largest_first() -> None:
    """The split a GPU run prints under its table: Triton kernels by name, CUDA C++ kernels by unqualified name,
    repeats added up, the smallest beyond the top folded into "other"."""
    module = load_benchmark("compress_step")
    assert module.kernel_name("_greedy_kernel") == "_greedy_kernel"
    assert module.kernel_name("void at::native::elementwise_kernel<128, 4>(int, at::native::F)") == (
        "elementwise_kernel")
    assert module.kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    events = [("_plan_kernel", 20.0), ("_greedy_kernel", 900.0), ("void cutlass::Kernel2<gemm>(Params)", 300.0),
              ("_plan_kernel", 10.0), ("_copy_kernel", 40.0)]
    assert module.busy_by_kernel(events) == {"_greedy_kernel": 0.9, "Kernel2": 0.3, "_copy_kernel": 0.04,
                                             "_plan_kernel": 0.03}
    assert module.busy_by_kernel(events, top=2) == {"_greedy_kernel": 0.9, "Kernel2": 0.3,
                                                    "other": pytest.approx(0.07)}


def test_the_warps_sweep_times_each_setting_and_keeps_the_ids(tmp_path: Path) -> None:
    """``--sweep-warps``, the data to tune the row and greedy kernels' warps on a GPU: every setting of each kernel
    runs (the interpreter ignores warps, so only the plumbing is checked here), keeps the PyTorch path's ids, and
    today's rule is marked at exactly one setting per kernel."""
    module = load_benchmark("compress_step")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert module.main(["--quick", "--device", device, "--repeats", "1", "--only", "frame, anchors [0]",
                        "--sweep-warps", "--out", str(tmp_path)]) == 0
    sweep = json.loads((tmp_path / "compress_step.json").read_text())["warps"]
    settings = {(r["kernel"], r["warps"]) for r in sweep}
    assert settings == set(module.swept(next(c for c in module.cases(True) if c.name == "frame, anchors [0]")))
    assert {("greedy", 1), ("plan + finish", 4), ("plan + finish", 32)} <= settings  # a few warps: the greedy run
    assert ("plan + finish", 1) not in settings  # only (a region's thousands of rows would spill on one warp)
    assert all(r["same_ids"] is True and r["wall_ms"] > 0 for r in sweep)
    for kernel in module.SWEEPS:
        assert sum(r["today"] for r in sweep if r["kernel"] == kernel) == 1
    assert "| frame, anchors [0] | greedy |" in (tmp_path / "compress_step.md").read_text()
    assert [getattr(m, name).__name__ for m, name in module.SWEEPS.values()] == ["_row_warps", "_warps"]  # put back
