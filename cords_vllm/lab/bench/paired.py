"""Paired comparison of two answer sets on the same questions (exact McNemar test).

Two runs that answer the same questions are compared on the questions where they disagree: ``b`` questions
only the first got right, ``c`` only the second. Under "equally accurate" each discordant question is a fair
coin, so the two-sided p-value is ``P(min(b, c) or fewer heads of b + c)`` doubled (capped at 1). Concordant
questions carry no information about the difference, which makes this test far sharper than comparing two
accuracies as if they came from independent samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb, sqrt


@dataclass(frozen=True)
class PairedDifference:
    """``first_only`` / ``second_only``: questions only that run answered right; ``p_value``: exact McNemar."""

    n: int
    first_only: int
    second_only: int
    p_value: float

    @property
    def discordant(self) -> int:
        return self.first_only + self.second_only

    def to_json(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def mcnemar_exact(first: Sequence[bool], second: Sequence[bool]) -> PairedDifference:
    """Exact two-sided McNemar test of two per-question hit lists of equal length (same questions, same order)."""
    if len(first) != len(second):
        raise ValueError(f"paired runs answer the same questions: {len(first)} vs {len(second)} hits")
    b = sum(1 for x, y in zip(first, second, strict=True) if x and not y)
    c = sum(1 for x, y in zip(first, second, strict=True) if y and not x)
    n = b + c
    tail = sum(comb(n, k) for k in range(min(b, c) + 1)) / 2**n if n else 1.0
    return PairedDifference(len(first), b, c, min(1.0, 2 * tail))


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of an accuracy of ``hits`` out of ``n`` (95% by default); ``(0, 1)`` for ``n = 0``."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # exact at the ends (the formula gives them up to rounding): no hit -> 0, every hit -> 1
    return (0.0 if hits == 0 else max(0.0, centre - half)), (1.0 if hits == n else min(1.0, centre + half))


@dataclass(frozen=True)
class CellComparison:
    """One budget cell: a policy's accuracy with its 95% interval, against the most accurate other policy there."""

    fraction: float
    policy: str
    accuracy: float
    interval: tuple[float, float]
    best_other: str
    best_other_accuracy: float
    paired: PairedDifference

    def row(self) -> str:
        """A markdown row: budget, policy (interval), best other, questions only each got right, p-value."""
        lo, hi = self.interval
        return (f"| 1/{round(1 / self.fraction)} | {100 * self.accuracy:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | "
                f"{self.best_other} {100 * self.best_other_accuracy:.1f}% | {self.paired.first_only} / "
                f"{self.paired.second_only} | {self.paired.p_value:.3g} |")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "paired": self.paired.to_json()}


def against_best_other(hits: dict[str, Sequence[bool]], policy: str, fraction: float) -> CellComparison:
    """``policy`` against the most accurate other entry of ``hits`` (label -> per-question hits, the same questions)
    in one cell, with the exact McNemar test on the questions they disagree on."""
    n = len(hits[policy])
    accuracy = {label: sum(h) / max(n, 1) for label, h in hits.items()}
    best = max((label for label in hits if label != policy), key=lambda label: (accuracy[label], label))
    return CellComparison(fraction, policy, accuracy[policy], wilson_interval(sum(hits[policy]), n), best,
                          accuracy[best], mcnemar_exact(hits[policy], hits[best]))
