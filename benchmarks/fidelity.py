"""Fidelity that can decide: per-question KL from full KV beside accuracy, with paired bootstrap intervals.

    python benchmarks/fidelity.py --seed 10000001                      # 64 frames, 32 fresh questions a family
    python benchmarks/fidelity.py --seed 10000002 --per-family 128 --fractions 0.125 0.0625
    python benchmarks/fidelity.py --seed 10000003 --tier hard --per-family 96     # counting over 128 frames

Two tiers: ``easy``, every question family at 64 frames, where full KV sits near its ceiling (95-99%), so
accuracy barely separates policies but KL does; ``hard``, counting events over 128 frames, where full KV on the
shipped model scores about 70-75% (the run prints a note when it leaves 60-90%), so accuracy can separate too.

Each cell (full KV once, then every policy at every fraction of the video's tokens) answers the same fresh
questions through an in-process vLLM engine on the shipped video-QA model (:mod:`cords_vllm.lab.bench.fidelity`);
the answer token's whole distribution is kept. Per cell: accuracy, mean ``KL(full || policy)``. Per budget,
``--reference`` (``cords``) against every other policy on the same questions: the paired bootstrap 95% interval
of the KL difference and of the accuracy difference, each with its verdict (decided only where the interval
excludes zero, or ``--kl-margin`` for non-inferiority), McNemar's p, and the questions a decision would need
(power 0.8 at the observed difference), and for the first ``--attention-questions`` questions every layer's
attention-output error at the answer (the HF reference replaying the engine's evictions). Writes
``fidelity.json``, ``fidelity.md`` and one plot per budget (``fidelity_kl_<fraction>.png``) to ``--out``.

**Fresh questions only.** ``--seed`` must be at least 10,000,000: the model's training stream and the fixed
evaluation splits (monitor, held-out, test: ``cords_vllm.lab.vqa.tasks.SPLIT_SEEDS``) use seeds below it, so no
tuning, checkpoint choice or earlier table has seen these questions. Use a new seed for every reported run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: Seeds below this belong to training or to the fixed evaluation splits.
FRESH_SEED_FLOOR = 10_000_000
#: ``(families, frames)`` of each tier; ``None``: every family the model was trained on.
TIERS: dict[str, tuple[list[str] | None, int]] = {"easy": (None, 64), "hard": (["count"], 128)}
#: The band a hard tier's full-KV accuracy should sit in, to separate policies.
HARD_BAND = (0.6, 0.9)
DEFAULT_POLICIES = ["cords", "uniform", "recency", "k_only", "v_only", "random", "infinipot_v", "snapkv", "streammem"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, required=True, help=f"question seed, >= {FRESH_SEED_FLOOR:,} and unused")
    p.add_argument("--checkpoint", default=None, help="default: the shipped trained model")
    p.add_argument("--tier", choices=sorted(TIERS), default="easy",
                   help="easy: every family at 64 frames (full KV near its ceiling); hard: counting events over 128 "
                        "frames (full KV about 70-75%% on the shipped model)")
    p.add_argument("--families", nargs="+", default=None, help="default: the tier's")
    p.add_argument("--per-family", type=int, default=32)
    p.add_argument("--frames", type=int, default=None, help="default: the tier's")
    p.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES)
    p.add_argument("--reference", default="cords")
    p.add_argument("--fractions", nargs="+", type=float, default=[1 / 4, 1 / 8, 1 / 16])
    p.add_argument("--kl-margin", type=float, default=0.0, help="non-inferiority margin in nats (0: none)")
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--attention-questions", type=int, default=8,
                   help="questions whose every layer's attention-output error is measured (HF reference replaying "
                        "the engine's evictions; seconds each)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/fidelity"))
    args = p.parse_args(argv)
    if args.seed < FRESH_SEED_FLOOR:
        p.error(f"--seed {args.seed} is below {FRESH_SEED_FLOOR:,}: training and the fixed splits use those seeds; "
                "pick a fresh one")
    if args.reference not in args.policies:
        p.error(f"--reference {args.reference!r} is not one of --policies")
    if args.per_family < 2 or not args.fractions or any(not 0 < f < 1 for f in args.fractions):
        p.error("need --per-family >= 2 and fractions in (0, 1)")

    from cords_vllm.lab.bench.accuracy import EngineShape
    from cords_vllm.lab.bench.fidelity import compare, evaluate_fidelity, markdown, parse_policies, plot_comparisons
    from cords_vllm.lab.vqa import FAMILIES, VideoGeometry, shipped_checkpoint
    from cords_vllm.lab.vqa.tasks import iter_examples

    try:
        policies = parse_policies(args.policies)
    except (KeyError, ValueError) as exc:
        p.error(str(exc))
    checkpoint = args.checkpoint or shipped_checkpoint()
    tier_families, tier_frames = TIERS[args.tier]
    families = args.families or tier_families or [getattr(f, "name", f) for f in FAMILIES]
    args.frames = args.frames or tier_frames
    geometry = VideoGeometry(num_frames=args.frames)
    examples = list(iter_examples(families, seed=args.seed, geometry=geometry, stop=args.per_family))
    shape = EngineShape(chunk=args.chunk, batch=args.batch)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(examples)} fresh questions (seed {args.seed}; {', '.join(families)}), {args.frames} frames = "
          f"{geometry.num_video_tokens} video tokens; cells: full, then {len(policies)} policies x "
          f"{len(args.fractions)} fractions", flush=True)
    t0 = time.perf_counter()

    def progress(cell) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {cell.label:14s} {cell.fraction or 'full'!s:8s} accuracy "
              f"{100 * cell.accuracy:5.1f}%  mean KL {cell.mean_kl:.4f}", flush=True)

    cells = evaluate_fidelity(checkpoint, examples, policies, args.fractions, shape, on_cell=progress,
                              attention_questions=min(args.attention_questions, len(examples)))
    rows = compare(cells, args.reference, kl_margin=args.kl_margin, resamples=args.resamples, seed=args.seed)
    full_accuracy = cells[0].accuracy
    if args.tier == "hard" and not HARD_BAND[0] <= full_accuracy <= HARD_BAND[1]:
        print(f"note: full KV scores {100 * full_accuracy:.1f}% here, outside the hard tier's "
              f"{100 * HARD_BAND[0]:.0f}-{100 * HARD_BAND[1]:.0f}% band", flush=True)
    header = (f"# Fidelity against full KV: {len(examples)} fresh questions (seed {args.seed}), {args.frames} frames, "
              f"{time.strftime('%Y-%m-%d')}")
    table = markdown(cells, rows, header)
    (args.out / "fidelity.md").write_text(table)
    (args.out / "fidelity.json").write_text(json.dumps({
        "argv": sys.argv[1:] if argv is None else argv, "seed": args.seed, "tier": args.tier,
        "questions": len(examples), "full_accuracy": full_accuracy,
        "frames": args.frames, "families": families, "kl_margin": args.kl_margin,
        "cells": [c.to_json() for c in cells], "comparisons": rows,
        "wall_s": time.perf_counter() - t0}, indent=1) + "\n")
    if not args.no_plots:
        plot_comparisons(rows, args.out, args.kl_margin)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
