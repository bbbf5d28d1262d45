"""Accuracy summaries of video-QA predictions: overall, per family and by needle position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from cords_vllm.lab.vqa.tasks import VQAExample


class Answered(Protocol):
    """Anything with a one-word reference ``answer`` (a :class:`VQAExample`, an lmms-eval task question)."""

    @property
    def answer(self) -> str: ...


def answer_hits(examples: Sequence[Answered], predictions: Sequence[str]) -> list[bool]:
    """Whether each prediction is its example's answer (exact match, whitespace stripped); same order."""
    if len(examples) != len(predictions):
        raise ValueError(f"{len(examples)} examples but {len(predictions)} predictions")
    return [p.strip() == e.answer for e, p in zip(examples, predictions, strict=True)]


def _rate(hits: Sequence[bool]) -> float | None:
    return sum(hits) / len(hits) if hits else None


def accuracy_report(examples: Sequence[VQAExample], predictions: Sequence[str], *,
                    position_bins: int = 4) -> dict[str, Any]:
    """Exact-match accuracy of ``predictions`` (answer words, whitespace stripped) on ``examples``.

    Returns a JSON-ready dict::

        {"n": int, "overall": float, "macro": float (mean over families),
         "families": {family: {"n": int, "accuracy": float,
                               "by_position": [acc or None per bin], "by_answer": {answer: acc}}}}

    ``by_position`` bins the earliest needle's position (``[0, 1)``) into ``position_bins`` equal bins;
    examples without needles (``count`` with answer ``"0"``) and ``static`` ones (their needle spans the
    whole video) are left out of the bins.
    """
    hits = answer_hits(examples, predictions)
    families: dict[str, Any] = {}
    for name in dict.fromkeys(e.family for e in examples):
        rows = [i for i, e in enumerate(examples) if e.family == name]
        bins: list[list[bool]] = [[] for _ in range(position_bins)]
        answers: dict[str, list[bool]] = {}
        for i in rows:
            ex = examples[i]
            answers.setdefault(ex.answer, []).append(hits[i])
            pos = ex.needle_position
            if pos is not None and name != "static":
                bins[min(int(pos * position_bins), position_bins - 1)].append(hits[i])
        families[name] = {
            "n": len(rows),
            "accuracy": _rate([hits[i] for i in rows]),
            "by_position": [_rate(b) for b in bins],
            "by_answer": {a: _rate(h) for a, h in sorted(answers.items())},
        }
    accs = [f["accuracy"] for f in families.values()]
    return {"n": len(hits), "overall": _rate(hits), "macro": sum(accs) / len(accs) if accs else None,
            "families": families}


def format_report(report: dict[str, Any]) -> str:
    """A few human-readable lines of an :func:`accuracy_report`."""
    lines = [f"overall {report['overall']:.3f} (macro {report['macro']:.3f}, n={report['n']})"]
    for name, f in report["families"].items():
        bins = " ".join("  -  " if b is None else f"{b:.2f}" for b in f["by_position"])
        lines.append(f"  {name:<7} {f['accuracy']:.3f} (n={f['n']})  by needle position: {bins}")
    return "\n".join(lines)
