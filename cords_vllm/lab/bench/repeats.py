"""Repeated throughput comparisons: rounds of every cell, compared with the baseline round by round.

One run of a few seconds moves by several percent from one run to the next on a shared machine, so "``cords``
is never slower than ``none``" cannot rest on one run. ``--repeats N`` runs ``N`` rounds; each round runs every
cell once, in an order rotated by one cell per round (no cell always runs first, or always right after the
same other one). A cell's speed-up is measured within each round, against the baseline's run of the same round
(the two runs closest in time), and reported as the median of the rounds with their range.

Pure: works on the runs' summaries (:meth:`~cords_vllm.lab.bench.offline.PolicyResult.summary`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

#: Columns of :func:`paired_speedups`'s rows, for :func:`~cords_vllm.lab.bench.report.format_table`.
PAIRED_COLUMNS = [("label", "policy", "{}"), ("median", "median speed-up", "{:.3f}x"),
                  ("min", "min", "{:.3f}x"), ("max", "max", "{:.3f}x"),
                  ("not_slower", "rounds >= 1.0x", "{}"), ("per_round", "per round", "{}")]


def round_order(cells: Sequence[T], round_index: int) -> list[T]:
    """The cells in the order round ``round_index`` runs them: rotated left by ``round_index`` places."""
    if not cells:
        return []
    shift = round_index % len(cells)
    return [*cells[shift:], *cells[:shift]]


def paired_speedups(rounds: Sequence[Sequence[dict[str, Any]]], baseline: str = "none") -> list[dict[str, Any]]:
    """Each cell's speed-up over ``baseline`` (the baseline's wall time over the cell's) in every round, with
    their median, range and how many rounds were at least level.

    ``rounds``: per round, the summaries (``label``, ``wall_s``) of its runs, every cell once, in any order.
    Returns one row per cell, in the first round's order, or ``[]`` when no round ran the baseline. Raises
    ``ValueError`` when the rounds did not run the same cells.
    """
    if not rounds:
        return []
    labels = [row["label"] for row in rounds[0]]
    walls: list[dict[str, float]] = []
    for index, runs in enumerate(rounds):
        wall = {row["label"]: float(row["wall_s"]) for row in runs}
        if sorted(wall) != sorted(labels) or len(wall) != len(runs):
            raise ValueError(f"round {index} ran {sorted(r['label'] for r in runs)}, round 0 ran {sorted(labels)}")
        walls.append(wall)
    if baseline not in labels:
        return []
    out = []
    for label in labels:
        speedups = [wall[baseline] / wall[label] for wall in walls]
        out.append({"label": label, "median": statistics.median(speedups), "min": min(speedups),
                    "max": max(speedups), "not_slower": f"{sum(s >= 1.0 for s in speedups)}/{len(speedups)}",
                    "per_round": ", ".join(f"{s:.3f}" for s in speedups), "speedups": speedups})
    return out


def median_run(runs: Sequence[T], wall_s: Sequence[float]) -> T:
    """The run of median wall time (the lower of the two middle ones for an even count): a cell's
    representative in the tables and plots."""
    if len(runs) != len(wall_s) or not runs:
        raise ValueError(f"{len(runs)} runs with {len(wall_s)} wall times")
    ranked = sorted(range(len(runs)), key=lambda i: (wall_s[i], i))
    return runs[ranked[(len(runs) - 1) // 2]]


def plot_paired(paired: Sequence[dict[str, Any]], baseline: str, path) -> None:
    """A PNG of :func:`paired_speedups`'s rows: each round's speed-up as a dot, the median as a bar, one column
    per cell, and the level line at 1.0 (the baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(paired) + 2.0), 4.5))
    for x, row in enumerate(paired):
        ax.hlines(row["median"], x - 0.3, x + 0.3, color="tab:blue", linewidth=2.5,
                  label="median" if x == 0 else None)
        ax.scatter([x] * len(row["speedups"]), row["speedups"], color="tab:orange", s=18, zorder=3,
                   label="one round" if x == 0 else None)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(paired)), [row["label"] for row in paired], rotation=30, ha="right")
    ax.set_ylabel(f"speed-up over {baseline} (same round)")
    ax.set_title(f"Speed-up over {baseline}, round by round ({len(paired[0]['speedups']) if paired else 0} rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
