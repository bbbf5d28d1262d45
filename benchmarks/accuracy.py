"""Accuracy of every KV policy on the shipped video-QA model, through the real vLLM engine.

    python benchmarks/accuracy.py --per-family 32                  # training-length videos (64 frames)
    python benchmarks/accuracy.py --per-family 32 --frames 128     # longer than any training video
    python benchmarks/accuracy.py --mode stream --per-family 16    # live streams, questions mid-stream

Reports accuracy per policy and budget (1/2, 1/4, 1/8, 1/16 of the video's tokens, plus full KV), per
question family and needle position, the effective budget each cell really held, the two sanity controls
(needles blanked -> chance; needle oracle -> full KV), and the coverage CDF of cords vs infinipot_v vs
uniform on the model's real keys/values. Writes results.json and PNG plots to --out.

``--mode stream`` pushes each video into an engine session in clips of ``--push-frames`` frames and asks its
question ``--delay-pushes`` pushes after the needle (:mod:`cords_vllm.lab.bench.stream_accuracy`); it reports the
same table (the video tokens held when answering in parentheses) and writes stream_results.json and the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cords_vllm.lab.bench.accuracy import AccuracyRun
    from cords_vllm.lab.bench.workload import PolicySpec
    from cords_vllm.lab.vqa import VQAExample

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    from cords_vllm.lab.vqa import FAMILIES, VideoGeometry, get_family, make_split, shipped_checkpoint
    from cords_vllm.selection import available_selectors

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="default: the shipped trained model")
    p.add_argument("--families", nargs="+", default=[getattr(f, "name", f) for f in FAMILIES])
    p.add_argument("--per-family", type=int, default=32)
    p.add_argument("--split", choices=["heldout", "monitor", "test"], default="heldout",
                   help="question split: tune on monitor, report heldout (test is kept unseen)")
    p.add_argument("--frames", type=int, default=64, help="video length (training used 64)")
    p.add_argument("--policies", nargs="+", default=available_selectors(),
                   help="registry names or variants NAME:key=value,... (e.g. cords:granularity=token,alpha=0.1); "
                        "vLLM's video pruning: evs, vidcom2 (alone, at the budget's share), evs+cords (pruning at "
                        "pruning_rate, default 0.5, then the policy)")
    p.add_argument("--fps", type=float, default=None,
                   help="send videos with their times at this frame rate (default: 2 for Qwen2.5-VL and Qwen3-VL "
                        "checkpoints, which need it; bare frames otherwise)")
    p.add_argument("--granularity", choices=["token", "frame", "block"], default=None,
                   help="selection unit for every policy (default: the engine's default); variants may override")
    p.add_argument("--fractions", nargs="+", type=float, default=[1 / 2, 1 / 4, 1 / 8, 1 / 16])
    p.add_argument("--chunk", type=int, default=64, help="prefill tokens per request per step")
    p.add_argument("--batch", type=int, default=16, help="requests prefilled together")
    p.add_argument("--inputs", nargs="+", choices=["video", "images"], default=["video"],
                   help="oneshot mode: how requests carry the video: one video input, and/or every frame as its own "
                        "image (as lmms-eval and VLMEvalKit send it); with both, a table compares them cell by cell")
    p.add_argument("--equal", choices=["frames", "kv"], default="frames",
                   help="with several --inputs, what the shapes share at a budget: the same share of their frames "
                        "(each budget a fraction of that shape's own tokens; images then hold twice the KV), or "
                        "the same KV (each budget a fraction of the first shape's tokens)")
    p.add_argument("--no-controls", action="store_true")
    p.add_argument("--mode", choices=["oneshot", "stream"], default="oneshot",
                   help="oneshot: one request per question; stream: video pushed into a session, question mid-stream")
    p.add_argument("--push-frames", type=int, default=8, help="stream mode: frames per push (even)")
    p.add_argument("--delay-pushes", type=int, default=2,
                   help="stream mode: pushes between the one holding the needle's last frame and the question")
    p.add_argument("--out", type=Path, default=None,
                   help="default: benchmarks/out/accuracy (oneshot), benchmarks/out/accuracy_stream (stream)")
    args = p.parse_args(argv)
    if args.mode == "stream":
        return stream_mode(args)
    args.out = args.out or Path("benchmarks/out/accuracy")


    from cords_vllm.lab.bench.accuracy import (
        EngineShape,
        blank_needles,
        coverage_on_model,
        evaluate,
        oracle_predictions,
        plot_accuracy,
        plot_inputs_comparison,
        run_policy,
    )
    from cords_vllm.lab.fidelity.coverage import max_cdf_gap
    from cords_vllm.lab.fidelity.plot import plot_coverage_cdfs
    from cords_vllm.lab.vqa import accuracy_report, format_report

    checkpoint = Path(args.checkpoint) if args.checkpoint else shipped_checkpoint()
    geometry = VideoGeometry(num_frames=args.frames)
    examples = make_split(args.families, args.per_family, args.split, geometry=geometry)
    shape = EngineShape(chunk=args.chunk, batch=args.batch, fps=video_fps(checkpoint, args.fps))
    specs = policy_specs(args)
    print(f"{len(examples)} {args.split} examples ({', '.join(args.families)}), {args.frames} frames = "
          f"{geometry.num_video_tokens} video tokens each; checkpoint {checkpoint.name}", flush=True)
    runs = with_progress(specs, args.fractions,
                         lambda report: evaluate(checkpoint, examples, specs, args.fractions, shape, on_cell=report,
                                                 inputs=args.inputs, equal=args.equal), repeats=len(args.inputs))

    for inputs in args.inputs:
        print(f"\n## {inputs}: " + ("one video input" if inputs == "video" else "every frame as its own image"))
        print_table([r for r in runs if r.inputs == inputs], specs, args.fractions)
    comparison = (compare_inputs(runs, specs, args.fractions, args.inputs, examples, args.equal)
                  if len(args.inputs) > 1 else None)
    for policy in ("cords", "recency", "uniform"):
        for run in runs:
            if run.label == policy and run.fraction == min(args.fractions, key=lambda x: abs(x - 1 / 8)):
                print(f"\n{policy} at 1/{round(1 / run.fraction)}: {format_report(run.report)}")

    payload = {"argv": sys.argv[1:], "split": args.split, "examples": len(examples), "frames": args.frames,
               "runs": [r.to_json() for r in runs]}
    cells = compare_with_best_other([r for r in runs if r.inputs == args.inputs[0]], examples, args.fractions)
    if cells:
        payload["cords_vs_best_other"] = [c.to_json() for c in cells]
    if comparison:
        payload["inputs_comparison"] = comparison
    if not args.no_controls:
        # `static` questions are about the whole video (their "needle" is every frame): nothing to blank
        blanked = [blank_needles(e) for e in examples if e.needles and e.family != "static"]
        predictions, _ = run_policy(checkpoint, blanked, "none", None, shape)
        blank = accuracy_report(blanked, predictions)
        chance = {e.family: round(1 / len(get_family(e.family).answers()), 3) for e in blanked}
        with_needle = [e for e in examples if e.needles and e.family != "static"]
        oracle = accuracy_report(with_needle, oracle_predictions(checkpoint, with_needle))
        full_same = accuracy_report(with_needle, run_policy(checkpoint, with_needle, "none", None, shape)[0])
        print(f"\ncontrol, needles blanked (full KV; chance per family {chance}): {format_report(blank)}")
        print(f"control, oracle keeping only the needle's video tokens (HF reference): {format_report(oracle)}")
        print(f"         full KV on the same examples: {format_report(full_same)}")
        payload["controls"] = {"blanked": blank, "chance": chance, "oracle": oracle, "full_same_examples": full_same}

    fraction = min(args.fractions, key=lambda x: abs(x - 1 / 8))
    curves = coverage_on_model(checkpoint, examples[: min(16, len(examples))], fraction)
    gaps = {space: max_cdf_gap(curves["cords"][space], curves["infinipot_v"][space]) for space in curves["cords"]}
    print(f"\ncoverage at 1/{round(1 / fraction)} (layer 0, real keys/values): max CDF gap cords - infinipot_v "
          + ", ".join(f"{s}: {g[0]:+.3f} at d={g[1]:.3f}" for s, g in gaps.items()))
    payload["coverage_max_gap_vs_infinipot_v"] = gaps
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    paths = []
    for inputs in args.inputs:
        paths += plot_accuracy([r for r in runs if r.inputs == inputs], args.out if inputs == "video" else
                               args.out / inputs, split=args.split)
    if comparison:
        shared = "same share of their frames" if args.equal == "frames" else "same KV held"
        paths.append(plot_inputs_comparison(comparison, args.out / "inputs_comparison.png",
                                            title=" vs ".join(args.inputs) + f": same questions, {shared}"))
    title = f"Coverage on the trained model's keys/values (budget 1/{round(1 / fraction)})"
    paths.append(plot_coverage_cdfs(curves, args.out / "coverage_cdf.png", reference=("cords", "infinipot_v"),
                                    title=title))
    for path in [args.out / "results.json", *paths]:
        print(f"wrote {path}")
    return 0


def compare_with_best_other(runs: list[AccuracyRun], examples: Sequence[VQAExample], fractions: list[float],
                            policy: str = "cords") -> list:
    """Print and return, per budget, ``policy``'s accuracy with its 95% Wilson interval against the most accurate
    other policy of the cell (``policy``'s own variants, ``policy:key=value``, are not others), with the exact
    McNemar test on the same questions (:func:`cords_vllm.lab.bench.paired.against_best_other`); empty when
    ``policy`` did not run."""
    from cords_vllm.lab.bench.paired import against_best_other

    truth = [e.answer for e in examples]
    cells = []
    for fraction in fractions:
        hits = {r.label: [p == t for p, t in zip(r.predictions, truth, strict=True)]
                for r in runs if r.fraction == fraction and not r.label.startswith(f"{policy}:")}
        if policy in hits and len(hits) > 1:
            cells.append(against_best_other(hits, policy, fraction))
    if cells:
        print(f"\n| budget | {policy} [95% interval] | best other | questions only {policy} / only it got right "
              "| p (exact McNemar) |\n|---|---|---|---|---|")
        for cell in cells:
            print(cell.row())
    return cells


def print_table(runs: list[AccuracyRun], specs: list[PolicySpec], fractions: list[float]) -> None:
    """Full KV's report, then the markdown table: accuracy (video tokens held when answering) per policy x budget."""
    from cords_vllm.lab.vqa import format_report

    full = runs[0]
    print(f"\nfull KV: {format_report(full.report)}")
    header = "| policy | " + " | ".join(f"1/{round(1 / f)} (held)" for f in fractions) + " |"
    print("\n" + header + "\n|" + "---|" * (len(fractions) + 1))
    from cords_vllm.lab.bench.pruning import budgeted

    for policy in (s.label for s in specs if budgeted(s)):
        cells_row = []
        for f in fractions:
            run = next(r for r in runs if r.label == policy and r.fraction == f)
            cells_row.append(f"{100 * run.report['overall']:.1f}% ({run.effective_video_tokens:.0f})")
        print(f"| {policy} | " + " | ".join(cells_row) + " |")
    print(f"| full KV | {100 * full.report['overall']:.1f}% ({full.effective_video_tokens:.0f}) |")


def compare_inputs(runs: list[AccuracyRun], specs: list[PolicySpec], fractions: list[float], inputs: list[str],
                   examples: Sequence[VQAExample], equal: str = "frames") -> list[dict[str, Any]]:
    """Print a markdown table of each cell's accuracy under every input shape (``video / images``) with the last
    shape's minus the first's in points and the exact McNemar p-value of that difference on the same questions
    (:mod:`cords_vllm.lab.bench.paired`); return the same comparisons as JSON rows. ``equal``: what the shapes'
    budgets share (see :func:`cords_vllm.lab.bench.accuracy.evaluate`); budgets are fractions of the first shape's
    tokens under ``"kv"``."""
    from cords_vllm.lab.bench.paired import mcnemar_exact
    from cords_vllm.lab.vqa import answer_hits

    shared = ("same share of their frames kept" if equal == "frames"
              else f"same KV held, budgets fractions of the {inputs[0]}'s tokens")
    print("\n## " + " vs ".join(inputs) + f" (same questions, {shared}; in parentheses: "
          f"{inputs[-1]} minus {inputs[0]} in points, exact McNemar p)")
    header = "| policy | " + " | ".join(f"1/{round(1 / f)}" for f in fractions) + " |"
    print(header + "\n|" + "---|" * (len(fractions) + 1))
    rows = []
    for label in ["none", *(s.label for s in specs if s.policy != "none")]:
        cells_row = []
        for f in ([None] if label == "none" else fractions):
            cell = [next(r for r in runs if r.label == label and r.fraction == f and r.inputs == i) for i in inputs]
            hits = [answer_hits(examples, r.predictions) for r in cell]
            test = mcnemar_exact(hits[0], hits[-1])
            accs = [r.report["overall"] for r in cell]
            gap = 100 * (accs[-1] - accs[0])
            mark = "=" if test.discordant == 0 else f"{gap:+.1f}, p={test.p_value:.2f}"
            cells_row.append(" / ".join(f"{100 * a:.1f}" for a in accs) + f" ({mark})")
            rows.append({"label": label, "fraction": f, "equal": equal,
                         "budget": dict(zip(inputs, (r.budget for r in cell), strict=True)),
                         "accuracy": dict(zip(inputs, accs, strict=True)), "mcnemar": test.to_json()})
        print(f"| {'full KV' if label == 'none' else label} | " + " | ".join(cells_row) + " |")
    return rows


def video_fps(checkpoint: Path, fps: float | None) -> float | None:
    """``fps``, else 2 for a checkpoint whose family needs its videos' times (Qwen2.5-VL, Qwen3-VL), else None."""
    if fps is not None:
        return fps
    model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type", "")
    return 2.0 if model_type in ("qwen2_5_vl", "qwen3_vl") else None


def policy_specs(args: argparse.Namespace) -> list[PolicySpec]:
    r"""``--policies`` as ``PolicySpec``\ s, with ``--granularity`` as every policy's default."""

    from cords_vllm.lab.bench import pruning

    defaults = {"granularity": args.granularity} if args.granularity else {}
    return [pruning.parse(text, defaults) for text in args.policies]


def with_progress(specs: list[PolicySpec], fractions: list[float],
                  run_cells: Callable[[Callable[[AccuracyRun], None]], list[AccuracyRun]], repeats: int = 1
                  ) -> list[AccuracyRun]:
    """``run_cells(on_cell)`` under a progress bar of its cells: full KV once, then each policy x budget (each
    ``repeats`` times, e.g. once per input shape)."""
    from tqdm import tqdm

    from cords_vllm.lab.bench.pruning import budgeted

    cells = repeats * (1 + len(fractions) * len([s for s in specs if budgeted(s)]))
    with tqdm(total=cells, desc="policy x budget", unit="cell") as bar:
        def report(run):
            bar.update(1)
            bar.set_postfix_str(f"{run.label} {run.fraction} {run.inputs} -> {run.report['overall']:.3f}")
        return run_cells(report)


def stream_mode(args: argparse.Namespace) -> int:
    """``--mode stream``: every policy x budget on live streams (questions mid-stream), table and plots."""

    from cords_vllm.lab.bench.accuracy import EngineShape, plot_accuracy
    from cords_vllm.lab.bench.stream_accuracy import evaluate_streams, plan_stream
    from cords_vllm.lab.vqa import VideoGeometry, format_report, make_split, shipped_checkpoint

    checkpoint = Path(args.checkpoint) if args.checkpoint else shipped_checkpoint()
    out = args.out or Path("benchmarks/out/accuracy_stream")
    examples = make_split(args.families, args.per_family, args.split, geometry=VideoGeometry(num_frames=args.frames))
    plans = [plan_stream(e, args.push_frames, args.delay_pushes) for e in examples]
    shape = EngineShape(chunk=args.chunk, batch=args.batch, fps=video_fps(checkpoint, args.fps))
    specs = policy_specs(args)
    pushes = [len(p.clips) for p in plans]
    print(f"{len(plans)} held-out streams ({', '.join(args.families)}) of {args.frames}-frame videos in pushes of "
          f"{args.push_frames} frames; question {args.delay_pushes} pushes after the needle's push, after "
          f"{min(pushes)}-{max(pushes)} pushes (mean {sum(pushes) / len(pushes):.1f}); checkpoint {checkpoint.name}",
          flush=True)
    runs = with_progress(specs, args.fractions,
                         lambda report: evaluate_streams(checkpoint, plans, specs, args.fractions, shape,
                                                         on_cell=report))
    print_table(runs, specs, args.fractions)
    print(f"\n(full KV holds every pushed video token: {runs[0].effective_video_tokens:.0f} on average at the "
          f"question, markers included; budgets are fractions of the {examples[0].geometry.num_video_tokens}-token "
          "video)")
    for run in runs[1:]:
        print(f"\n{run.label} at 1/{round(1 / run.fraction)}: {format_report(run.report)}")
    payload = {"argv": sys.argv[1:], "mode": "stream", "split": args.split, "examples": len(plans),
               "frames": args.frames, "push_frames": args.push_frames, "delay_pushes": args.delay_pushes,
               "pushes": pushes, "needle_push": [p.needle_push for p in plans], "runs": [r.to_json() for r in runs]}
    cells = compare_with_best_other(runs, examples, args.fractions)
    if cells:
        payload["cords_vs_best_other"] = [c.to_json() for c in cells]
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream_results.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    for path in [out / "stream_results.json", *plot_accuracy(runs, out, split=args.split)]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
