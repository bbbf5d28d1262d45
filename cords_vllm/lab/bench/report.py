"""Tables, ratios against ``none``, JSON and plots for throughput results."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

COLUMNS = [
    ("label", "policy", "{}"), ("requests_per_s", "req/s", "{:.3f}"),
    ("prefill_tok_per_s", "prefill tok/s", "{:.0f}"),
    ("output_tok_per_s", "out tok/s", "{:.1f}"), ("ttft_p50_s", "TTFT p50 s", "{:.1f}"),
    ("ttft_p90_s", "TTFT p90 s", "{:.1f}"), ("peak_running", "peak running", "{}"),
    ("peak_decoding", "peak decoding", "{}"), ("peak_kv_blocks", "peak KV blocks", "{}"),
    ("preemptions", "preempt", "{}"),
    ("compressions", "compress", "{}"), ("selection_share", "select %", "{:.1%}"), ("wall_s", "wall s", "{:.1f}"),
]


def format_table(rows: Sequence[dict[str, Any]], columns=COLUMNS) -> str:
    """A plain-text (Markdown) table of summaries."""
    header = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [header, rule]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            missing = value is None or (isinstance(value, float) and math.isnan(value))
            cells.append("-" if missing else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(rows: Sequence[dict[str, Any]], baseline: str = "none") -> list[dict[str, Any]]:
    """Each policy against ``baseline``: throughput, concurrency and TTFT ratios (higher is better)."""
    base = next((r for r in rows if r["label"] == baseline), None)
    if base is None:
        return []
    out = []
    for r in rows:
        out.append({
            "label": r["label"],
            "speedup": base["wall_s"] / r["wall_s"],
            "requests_per_s_x": r["requests_per_s"] / base["requests_per_s"],
            "peak_running_x": r["peak_running"] / max(base["peak_running"], 1),
            "peak_decoding_x": r.get("peak_decoding", 0) / max(base.get("peak_decoding", 0), 1),
            "ttft_p50_x": base["ttft_p50_s"] / r["ttft_p50_s"] if r["ttft_p50_s"] else float("nan"),
            "peak_kv_blocks_x": r["peak_kv_blocks"] / max(base["peak_kv_blocks"], 1),
        })
    return out


RATIO_COLUMNS = [("label", "policy", "{}"), ("speedup", "workload speed-up", "{:.2f}x"),
                 ("peak_running_x", "peak running", "{:.2f}x"), ("peak_decoding_x", "peak decoding", "{:.2f}x"),
                 ("ttft_p50_x", "TTFT p50 speed-up", "{:.2f}x"),
                 ("peak_kv_blocks_x", "peak KV blocks", "{:.2f}x")]


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")


def plot_results(results: Sequence[Any], out_dir: Path) -> list[Path]:
    """PNG plots: throughput and peak concurrency per policy; KV blocks in use over time (none vs cords)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [r.label for r in results]
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].bar(labels, [r.requests_per_second for r in results], color="tab:blue")
    axes[0].set_ylabel("requests / s")
    axes[0].set_title("Throughput")
    x = np.arange(len(labels))
    axes[1].bar(x - 0.2, [r.peak_running for r in results], 0.4, color="tab:green", label="running (admitted)")
    axes[1].bar(x + 0.2, [r.peak_decoding for r in results], 0.4, color="tab:olive", label="decoding (holding KV)")
    axes[1].set_xticks(x, labels)
    axes[1].legend()
    axes[1].set_ylabel("requests at once (peak)")
    axes[1].set_title("Peak concurrency")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
        for tick in ax.get_xticklabels():
            tick.set_ha("right")
    fig.tight_layout()
    paths.append(out_dir / "throughput_concurrency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if r.label in ("none", "cords") and r.timeline:
            t, blocks, _ = zip(*r.timeline, strict=True)
            ax.step(t, blocks, where="post", label=f"{r.label} (peak {r.peak_blocks_in_use})")
    total = results[0].total_blocks
    ax.axhline(total, color="gray", linestyle="--", linewidth=1, label=f"pool ({total} blocks)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV blocks in use")
    ax.set_title("KV cache blocks in use over the run")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "kv_blocks_over_time.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
