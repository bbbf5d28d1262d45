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
from math import comb


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
