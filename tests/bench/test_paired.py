"""Exact McNemar test of paired runs, against hand values and a brute-force sign-test enumeration."""

from __future__ import annotations

import itertools

import pytest

from cords_vllm.lab.bench.paired import mcnemar_exact


def _brute_force_p(b: int, c: int) -> float:
    """Two-sided p by enumerating every assignment of the b + c discordant questions to the two runs: the
    share of assignments at least as lopsided as the observed one."""
    n = b + c
    if n == 0:
        return 1.0
    extreme = abs(b - c)
    outcomes = list(itertools.product((0, 1), repeat=n))
    return sum(1 for o in outcomes if abs(2 * sum(o) - n) >= extreme) / len(outcomes)


@pytest.mark.parametrize(("b", "c"), [(0, 0), (1, 0), (3, 1), (5, 0), (2, 2), (7, 3), (0, 9), (6, 5)])
def test_mcnemar_exact_matches_enumeration(b: int, c: int) -> None:
    first = [True] * b + [False] * c + [True] * 4 + [False] * 3
    second = [False] * b + [True] * c + [True] * 4 + [False] * 3
    result = mcnemar_exact(first, second)
    assert (result.n, result.first_only, result.second_only) == (b + c + 7, b, c)
    assert result.p_value == pytest.approx(_brute_force_p(b, c))


def test_mcnemar_exact_hand_values_and_order() -> None:
    assert mcnemar_exact([True] * 5, [False] * 5).p_value == pytest.approx(2 / 32)
    assert mcnemar_exact([True, False], [False, True]).p_value == 1.0
    shuffled = mcnemar_exact([True, False, True, True], [False, False, True, False])
    assert (shuffled.first_only, shuffled.second_only) == (2, 0)


def test_mcnemar_exact_refuses_unpaired_runs() -> None:
    with pytest.raises(ValueError, match="same questions"):
        mcnemar_exact([True, False], [True])


def test_wilson_interval_against_hand_values() -> None:
    from cords_vllm.lab.bench.paired import wilson_interval

    lo, hi = wilson_interval(64, 128)  # p = 0.5, n = 128: centre 0.5, half-width 1.96 * sqrt(0.25 / 128) shrunk
    assert lo == pytest.approx(0.4147, abs=1e-4) and hi == pytest.approx(0.5853, abs=1e-4)
    assert wilson_interval(128, 128) == pytest.approx((128 / (128 + 1.96**2), 1.0))  # all right: n / (n + z^2)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_a_cell_is_compared_with_its_most_accurate_other_policy() -> None:
    from cords_vllm.lab.bench.paired import against_best_other

    hits = {"cords": [True, True, False, False], "a": [True, False, False, False], "b": [False, True, True, True]}
    cell = against_best_other(hits, "cords", 0.125)
    assert (cell.best_other, cell.accuracy, cell.best_other_accuracy) == ("b", 0.5, 0.75)
    assert (cell.paired.first_only, cell.paired.second_only) == (1, 2)
    assert cell.row().startswith("| 1/8 | 50.0% [")
