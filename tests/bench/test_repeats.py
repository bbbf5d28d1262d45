"""Repeated throughput rounds: rotated order, speed-ups paired by round, the median run as representative."""

from __future__ import annotations

import pytest

from cords_vllm.lab.bench.repeats import median_run, paired_speedups, round_order


def test_each_round_rotates_the_order_so_no_cell_always_runs_first():
    cells = ["none", "cords", "evs"]
    orders = [round_order(cells, r) for r in range(4)]
    assert orders == [["none", "cords", "evs"], ["cords", "evs", "none"], ["evs", "none", "cords"],
                      ["none", "cords", "evs"]]
    assert {o[0] for o in orders[:3]} == set(cells)
    assert round_order([], 2) == []


def _round(**walls: float) -> list[dict]:
    return [{"label": label.replace("_", "+"), "wall_s": wall} for label, wall in walls.items()]


def test_speedups_pair_each_cell_with_the_baseline_of_its_own_round():
    # the machine slows down in round 2 for every cell: paired ratios stay level, unpaired ones would not
    rounds = [_round(none=4.0, cords=3.8, evs=2.0), _round(cords=5.7, none=6.0, evs=3.1),
              _round(evs=2.1, none=4.2, cords=4.4)]
    rows = {r["label"]: r for r in paired_speedups(rounds)}
    assert list(rows) == ["none", "cords", "evs"]
    assert rows["none"]["speedups"] == [1.0, 1.0, 1.0] and rows["none"]["not_slower"] == "3/3"
    assert rows["cords"]["speedups"] == pytest.approx([4.0 / 3.8, 6.0 / 5.7, 4.2 / 4.4])
    assert rows["cords"]["median"] == pytest.approx(4.0 / 3.8)  # 1.0526 = 6.0 / 5.7, the middle of three
    assert rows["cords"]["min"] == pytest.approx(4.2 / 4.4) and rows["cords"]["not_slower"] == "2/3"
    assert rows["evs"]["max"] == pytest.approx(2.0)
    assert rows["cords"]["per_round"] == "1.053, 1.053, 0.955"


def test_rounds_must_run_the_same_cells_and_need_the_baseline():
    with pytest.raises(ValueError, match="round 1 ran"):
        paired_speedups([_round(none=1.0, cords=1.0), _round(none=1.0, evs=1.0)])
    with pytest.raises(ValueError, match="round 1 ran"):
        paired_speedups([_round(none=1.0, cords=1.0), _round(none=1.0, cords=1.0) + _round(cords=2.0)])
    assert paired_speedups([_round(cords=1.0, evs=2.0)]) == []
    assert paired_speedups([]) == []


def test_the_representative_run_is_the_one_of_median_wall_time():
    assert median_run(["a", "b", "c"], [3.0, 1.0, 2.0]) == "c"
    assert median_run(["a", "b", "c", "d"], [4.0, 1.0, 3.0, 2.0]) == "d"  # the lower middle of an even count
    assert median_run(["a"], [9.0]) == "a"
    with pytest.raises(ValueError):
        median_run(["a"], [1.0, 2.0])


def test_the_rounds_plot_is_written(tmp_path):
    from cords_vllm.lab.bench.repeats import plot_paired

    rows = paired_speedups([_round(none=4.0, cords=3.8), _round(none=6.0, cords=5.7), _round(none=4.2, cords=4.4)])
    plot_paired(rows, "none", tmp_path / "rounds.png")
    assert (tmp_path / "rounds.png").stat().st_size > 10_000
