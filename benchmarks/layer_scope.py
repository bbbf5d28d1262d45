"""Layer-selective compression against compressing every layer: accuracy, paired test and KV held, from
``benchmarks/accuracy.py`` results.

    python benchmarks/accuracy.py --frames 64 --policies cords cords:compressed_layers=2 cords:compressed_layers=1 \\
        --out benchmarks/out/acc_layers_64f
    python benchmarks/layer_scope.py benchmarks/out/acc_layers_64f/results.json --layers 4

For each ``cords`` variant and budget: accuracy with its 95% Wilson interval, the exact McNemar test against
``cords`` with every layer compressed on the same questions (questions only the variant got right / only every-layer
``cords`` got right), and the KV a request held when it answered as a share of full KV, in the pool's own units:
every compressed layer holds the cell's video tokens, every whole layer all of them, padding layers included
(:func:`cords_vllm.compress.layer_scope.kv_cache_layout`; text tokens, equal in every cell, left out). Writes the
markdown table and ``accuracy_vs_kv.png`` (accuracy against KV held, one line per layer scope) next to the results.
No engine runs here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cords_vllm.compress.layer_scope import kv_cache_layout
from cords_vllm.lab.bench.paired import mcnemar_exact, wilson_interval
from cords_vllm.lab.vqa.metrics import answer_hits

BASE = "cords"


def compressed_layers(run: dict[str, Any], layers: int) -> int:
    """The layers a run compressed (every layer unless its configuration says ``compressed_layers``)."""
    return int(run["config"].get("compressed_layers") or layers)


def questions(results: dict[str, Any]) -> list[Any]:
    """The questions the accuracy benchmark asked, rebuilt from its command line (families, per-family count,
    split, frames), in its order."""
    from cords_vllm.lab.vqa import FAMILIES, VideoGeometry, make_split

    argv = results["argv"]

    def values(flag: str) -> list[str]:
        if flag not in argv:
            return []
        start = argv.index(flag) + 1
        end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
        return argv[start:end]

    families = values("--families") or [getattr(f, "name", f) for f in FAMILIES]
    per_family = int((values("--per-family") or ["32"])[0])
    examples = make_split(families, per_family, results["split"], geometry=VideoGeometry(num_frames=results["frames"]))
    if len(examples) != results["examples"]:
        raise ValueError(f"rebuilt {len(examples)} questions, the results answered {results['examples']}")
    return examples


def rows(results: dict[str, Any], layers: int) -> list[dict[str, Any]]:
    """One row per ``cords`` run: label, budget fraction, hits, KV share and the paired test against ``cords``."""
    examples = questions(results)
    full = next(r for r in results["runs"] if r["fraction"] is None)
    video = float(full["effective_video_tokens"])
    runs = [r for r in results["runs"] if r["policy"] == BASE and r["fraction"] is not None]
    base = {r["fraction"]: r for r in runs if r["label"] == BASE}
    out = []
    for run in runs:
        hits = answer_hits(examples, run["predictions"])
        reference = answer_hits(examples, base[run["fraction"]]["predictions"])
        layout = kv_cache_layout(compressed_layers(run, layers), layers)
        share = layout.layer_tokens(run["effective_video_tokens"], video) / (layers * video)
        out.append({"label": run["label"], "fraction": run["fraction"], "compressed": layout.compressed,
                    "hits": sum(hits), "n": len(hits), "kv_share": share,
                    "paired": mcnemar_exact(hits, reference), "held": run["effective_video_tokens"]})
    return out


def table(data: list[dict[str, Any]], results: dict[str, Any], layers: int) -> str:
    fractions = sorted({d["fraction"] for d in data}, reverse=True)
    full = next(r for r in results["runs"] if r["fraction"] is None)
    lines = [f"{results['frames']} frames, {results['split']} split, {layers} attention layers; full KV "
             f"{100 * full['report']['overall']:.1f}% ({full['effective_video_tokens']:.0f} video tokens)", "",
             "| compressed layers | " + " | ".join(f"1/{round(1 / f)}" for f in fractions) + " |",
             "|---|" + "---|" * len(fractions)]
    for label in dict.fromkeys(d["label"] for d in data):
        cells = {d["fraction"]: d for d in data if d["label"] == label}
        first = next(iter(cells.values()))
        name = f"all {layers}" if first["compressed"] == layers else f"0..{first['compressed'] - 1}"
        text = []
        for f in fractions:
            d = cells[f]
            lo, hi = wilson_interval(d["hits"], d["n"])
            paired = "" if label == BASE else (f"; +{d['paired'].first_only}/-{d['paired'].second_only} vs all, "
                                               f"p = {d['paired'].p_value:.2g}")
            text.append(f"{100 * d['hits'] / d['n']:.1f}% [{100 * lo:.0f}-{100 * hi:.0f}] "
                        f"({100 * d['kv_share']:.0f}% KV{paired})")
        lines.append(f"| {name} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def plot(data: list[dict[str, Any]], full: float, path: Path, title: str) -> None:
    """Accuracy (95% Wilson intervals) against KV held, one line per layer scope; full KV as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label in dict.fromkeys(d["label"] for d in data):
        cells = sorted((d for d in data if d["label"] == label), key=lambda d: d["kv_share"])
        name = "every layer" if label == BASE else label.split(":", 1)[1]
        accuracy = [100 * d["hits"] / d["n"] for d in cells]
        bounds = [wilson_interval(d["hits"], d["n"]) for d in cells]
        errors = [[a - 100 * lo for a, (lo, _) in zip(accuracy, bounds, strict=True)],
                  [100 * hi - a for a, (_, hi) in zip(accuracy, bounds, strict=True)]]
        ax.errorbar([100 * d["kv_share"] for d in cells], accuracy, yerr=errors, fmt="o-", capsize=3, label=name,
                    linewidth=2.5 if label == BASE else 1.5)
    ax.axhline(100 * full, color="gray", linestyle="--", label="full KV")
    ax.set_xlim(0, 100)
    ax.set_xlabel("video KV held when answering (% of full KV)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="results.json of benchmarks/accuracy.py with cords variants")
    p.add_argument("--layers", type=int, default=4, help="the model's attention layers (the shipped model: 4)")
    p.add_argument("--out", type=Path, default=None, help="directory for the table and plot (default: beside)")
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    data = rows(results, args.layers)
    text = table(data, results, args.layers)
    print(text)
    out = args.out or args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    stem = args.results.stem
    (out / f"{stem}_layer_scope.md").write_text(text + "\n")
    full = next(r for r in results["runs"] if r["fraction"] is None)["report"]["overall"]
    title = f"layer scope: {results['frames']} frames, {results['split']} questions"
    plot(data, full, out / f"{stem}_accuracy_vs_kv.png", title)
    print(f"wrote {out / f'{stem}_layer_scope.md'} and {out / f'{stem}_accuracy_vs_kv.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
