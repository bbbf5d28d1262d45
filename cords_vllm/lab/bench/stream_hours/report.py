"""An hours-long stream run's figures: its summary (KV flat, memory growth, push cost, answers), the agreement of
each policy with ``none``, the results file, the Markdown table and the plot."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cords_vllm.lab.bench.stream_hours.plan import QUESTIONS, HoursConfig
from cords_vllm.lab.bench.stream_hours.records import PolicyRun, PushRecord


def _tenth(n: int) -> int:
    return max(1, math.ceil(n / 10))


def rss_growth(records: Sequence[PushRecord], key: Callable[[PushRecord], float] | None = None) -> dict[str, Any]:
    """RSS growth after warm-up (the first 10% of pushes): a least-squares line of RSS against video hours over
    the other pushes; ``pct_per_hour`` is its slope over the RSS at the end of warm-up. ``late_pct_per_hour``:
    the same over the second half of the pushes only, which tells growth that goes on (a leak) from growth that
    levels off (caches and the allocator's heap filling to their size)."""
    key = key or (lambda r: r.rss_mb)
    warm = _tenth(len(records))
    rest = records[warm:]
    if len(rest) < 2:
        return {"mb_per_hour": None, "pct_per_hour": None, "start_mb": None, "end_mb": None,
                "late_mb_per_hour": None, "late_pct_per_hour": None}
    start = float(key(records[warm - 1]))
    slope = _slope(rest, key)
    late = _slope(records[len(records) // 2:], key)
    return {"mb_per_hour": slope, "pct_per_hour": 100 * slope / start if start else None, "start_mb": start,
            "end_mb": float(key(rest[-1])), "delta_mb": float(key(rest[-1]) - start),
            "late_mb_per_hour": late, "late_pct_per_hour": 100 * late / start if start else None}


def _slope(records: Sequence[PushRecord], key: Callable[[PushRecord], float]) -> float:
    """MB per hour of video: the least-squares slope of ``key`` over ``records``."""
    hours = np.array([r.video_s / 3600 for r in records])
    if len(records) < 2 or np.ptp(hours) == 0:
        return 0.0
    return float(np.polyfit(hours, np.array([key(r) for r in records]), 1)[0])


def summarise(run: PolicyRun, cfg: HoursConfig) -> dict[str, Any]:
    """The run's figures: pushes and video reached, KV blocks first / last (``kv_flat``: their peak after warm-up,
    the first 10% of pushes, passes the peak during it by at most the blocks of the protected text added since,
    questions and answers, which are never evicted, plus one; ``kv_within_footprint``: never above the footprint
    the stream was admitted with), RSS growth after warm-up, push wall time and server CPU time ratios (medians
    of the last 10% of pushes over the first 10%; the load average tells whether other work shared the machine),
    questions right / asked, and where the stream ended."""
    recs = run.records
    out: dict[str, Any] = {"policy": run.policy, "pushes": len(recs), "planned_pushes": cfg.pushes,
                           "video_hours": recs[-1].video_s / 3600 if recs else 0.0,
                           "video_tokens": recs[-1].video_tokens if recs else 0, "pool_blocks": run.pool_blocks,
                           "stopped": run.stopped, "stopped_push": run.stopped_push,
                           "stopped_status": run.stopped_status, "stopped_during": run.stopped_during,
                           "stopped_video_s": (run.stopped_push * cfg.clip_seconds
                                               if run.stopped_push is not None else None),
                           "errors": len(run.errors), "log_errors": len(run.log_errors), "wall_s": run.wall_s,
                           "startup_s": run.startup_s}
    if not recs:
        return out
    n = _tenth(len(recs))
    blocks = [r.pool_blocks for r in recs]
    first, last = np.median([r.push_s for r in recs[:n]]), np.median([r.push_s for r in recs[-n:]])
    cpu_first, cpu_last = np.median([r.cpu_s for r in recs[:n]]), np.median([r.cpu_s for r in recs[-n:]])
    text_blocks = math.ceil(max(0, recs[-1].text_tokens - recs[n - 1].text_tokens) / cfg.block_size)
    growth = max(blocks[n:], default=0) - max(blocks[:n])
    out.update({
        "kv_blocks_first": blocks[0], "kv_blocks_last": blocks[-1], "kv_blocks_peak": max(blocks),
        "kv_blocks_peak_warmup": max(blocks[:n]), "kv_blocks_peak_after_warmup": max(blocks[n:], default=None),
        "kv_blocks_growth_after_warmup": growth, "text_tokens_first": recs[0].text_tokens,
        "text_tokens_last": recs[-1].text_tokens, "text_blocks_added_after_warmup": text_blocks,
        "kv_flat": growth <= text_blocks + 1,
        "footprint_blocks": run.footprint_blocks,
        "kv_within_footprint": run.footprint_blocks is None or max(blocks) <= run.footprint_blocks,
        "listing_kv_blocks_last": recs[-1].kv_blocks,
        "positions_last": recs[-1].positions,
        "rss": rss_growth(recs),
        "rss_by_process": {name: rss_growth(recs, lambda r, name=name: r.rss_by_process.get(name, 0.0))
                           for name in recs[-1].rss_by_process},
        "push_s_median_first10": float(first), "push_s_median_last10": float(last),
        "push_s_ratio_last_first": float(last / first) if first else None,
        "cpu_s_median_first10": float(cpu_first), "cpu_s_median_last10": float(cpu_last),
        "cpu_s_ratio_last_first": float(cpu_last / cpu_first) if cpu_first else None,
        "load1_mean_first10": float(np.mean([r.load1 for r in recs[:n]])),
        "load1_mean_last10": float(np.mean([r.load1 for r in recs[-n:]])),
        "questions_right": sum(q.correct for q in run.questions), "questions_asked": len(run.questions),
        "questions_by_kind": {kind: [sum(q.correct for q in run.questions if q.kind == kind),
                                     sum(q.kind == kind for q in run.questions)] for kind in QUESTIONS},
        "stale_answers": sum(q.stale for q in run.questions),
    })
    return out


def agreement_with_none(runs: Sequence[PolicyRun]) -> dict[str, dict[str, Any]]:
    """Per policy other than ``none``: of the questions both it and ``none`` answered (``none`` stops at its rotary
    range), how many got the same answer. Where they agree, what the policy evicted did not change the answer,
    right or wrong: the compression's own fidelity, apart from how well the model answers."""
    reference = next((r for r in runs if r.policy == "none"), None)
    if reference is None:
        return {}
    asked = {(q.checkpoint, q.kind): q.predicted for q in reference.questions}
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run is reference:
            continue
        both = [(q, asked[q.checkpoint, q.kind]) for q in run.questions if (q.checkpoint, q.kind) in asked]
        out[run.policy] = {"questions": len(both), "same_answer": sum(q.predicted == p for q, p in both),
                           "right": sum(q.correct for q, _ in both),
                           "none_right": sum(p == q.answer for q, p in both)}
    return out


def write_results(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON with every list of numbers on one line (per-push columns stay small)."""
    text = json.dumps(payload, indent=1, default=float)
    text = re.sub(r"\[\s+([^\[\]{}\"]*?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _fmt(value: Any, spec: str = "{}") -> str:
    return "-" if value is None else spec.format(value)


def format_summary(summaries: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of :func:`summarise` results, one row per policy."""
    lines = ["| policy | pushes | video h | KV blocks first / last (peak) | flat | RSS after warm-up | "
             "RSS %/h (2nd half) | push s first / last 10% | ratio | CPU s ratio | load first / last | "
             "right / asked | ended |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if not s["pushes"]:
            lines.append(f"| {s['policy']} | 0 | - | - | - | - | - | - | - | - | - | - | {s['stopped']} |")
            continue
        rss = s["rss"]
        ended = "reached the end" if s["stopped"] is None else (
            f"HTTP {s['stopped_status']} at push {s['stopped_push']} ({s['stopped_during']})")
        lines.append(
            f"| {s['policy']} | {s['pushes']} | {s['video_hours']:.3f} | {s['kv_blocks_first']} / "
            f"{s['kv_blocks_last']} ({s['kv_blocks_peak']}) | {'yes' if s['kv_flat'] else 'no'} | "
            f"{_fmt(rss['start_mb'], '{:.0f}')} -> {_fmt(rss['end_mb'], '{:.0f}')} MB | "
            f"{_fmt(rss['pct_per_hour'], '{:+.2f}')} ({_fmt(rss['late_pct_per_hour'], '{:+.2f}')}) | "
            f"{s['push_s_median_first10']:.3f} / "
            f"{s['push_s_median_last10']:.3f} | {_fmt(s['push_s_ratio_last_first'], '{:.2f}x')} | "
            f"{_fmt(s['cpu_s_ratio_last_first'], '{:.2f}x')} | {s['load1_mean_first10']:.1f} / "
            f"{s['load1_mean_last10']:.1f} | "
            f"{s['questions_right']} / {s['questions_asked']} | {ended} |")
    return "\n".join(lines)


def plot_runs(runs: Sequence[PolicyRun], path: Path, title: str = "") -> Path:
    """Three panels against video time, one line per policy: KV blocks held, server RSS, push wall time (and,
    dashed, the server's CPU seconds per push)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for run in runs:
        minutes = [r.video_s / 60 for r in run.records]
        axes[0].plot(minutes, [r.pool_blocks for r in run.records], label=run.policy)
        axes[1].plot(minutes, [r.rss_mb for r in run.records], label=run.policy)
        line, = axes[2].plot(minutes, [r.push_s for r in run.records], label=f"{run.policy}: wall", linewidth=0.6)
        axes[2].plot(minutes, [r.cpu_s for r in run.records], label=f"{run.policy}: server CPU", linewidth=0.6,
                     linestyle="--", color=line.get_color())
        if run.stopped is not None and run.records:
            axes[0].plot(minutes[-1], run.records[-1].pool_blocks, "x", color="black")
    axes[0].set_ylabel("KV blocks held")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("server RSS (MB, all processes)")
    axes[2].set_ylabel("seconds per push")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("video streamed (minutes)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
