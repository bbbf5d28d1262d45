"""A step of the GPU check and the summary table: each step runs alone, PASS / FAIL / SKIP with why, timed."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class Skip(Exception):
    """A step that does not apply here; its message is the reason."""


class Fail(Exception):
    """A step whose check failed; its message says what."""


@dataclass
class Row:
    """One line of the summary table."""

    step: str
    result: str
    seconds: float
    detail: str = ""


def timed(step: str, fn: Callable[[], str]) -> Row:
    """Run ``fn`` as ``step``: PASS with its returned detail, SKIP / FAIL on :class:`Skip` / anything raised."""
    start = time.perf_counter()
    try:
        detail, result = fn(), PASS
    except Skip as exc:
        detail, result = str(exc), SKIP
    except Exception as exc:
        detail, result = (str(exc) if isinstance(exc, Fail) else f"{type(exc).__name__}: {exc}"), FAIL
    row = Row(step, result, time.perf_counter() - start, " ".join(detail.split()))
    print(f"gpu-check: {row.result} {row.step} ({row.seconds:.1f} s) {row.detail[:300]}", file=sys.stderr, flush=True)
    return row


def format_table(rows: Sequence[Row], width: int = 150) -> str:
    """The summary table: step, result, seconds, detail (cut to fit ``width`` characters)."""
    name = max([len(r.step) for r in rows] + [4])
    lines = [f"{'step':<{name}}  result  seconds  detail", f"{'-' * name}  ------  -------  ------"]
    room = max(20, width - name - 19)
    for r in rows:
        detail = r.detail if len(r.detail) <= room else r.detail[: room - 3] + "..."
        lines.append(f"{r.step:<{name}}  {r.result:<6}  {r.seconds:7.1f}  {detail}")
    return "\n".join(lines)
