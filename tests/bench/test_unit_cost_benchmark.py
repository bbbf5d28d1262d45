"""``benchmarks/unit_cost.py`` end to end at a small shape: every unit timed, ``auto`` resolved as the worker does."""

from __future__ import annotations

from tests.scripts import load_benchmark


def test_the_benchmark_times_frame_auto_and_token(capsys) -> None:
    module = load_benchmark("unit_cost")
    assert module.main(["--shape", "512:96:32", "--heads", "2", "--head-size", "16", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 512 |")]
    # 96 kept of 32-token frames: the widest run dividing a frame that still keeps 32 units is 2 tokens
    assert [r.split(" | ")[3] for r in rows] == ["frame", "auto (block, runs of 2)", "token"]
    assert rows[0].endswith("| 1.0x |")
