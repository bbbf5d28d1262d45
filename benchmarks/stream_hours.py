"""One live stream for hours of video through ``vllm serve``: KV held, server RSS and push time, per policy.

    python benchmarks/stream_hours.py                        # 2.05 h of 2 fps 448x448 video, none then cords
    python benchmarks/stream_hours.py --hours 0.05 --ask-every-min 1 --old-event-min 0.5   # a quick look

The tiny video-QA model (``--checkpoint``: the shipped one by default) is served with Qwen2-VL-7B's rotary range
(``--hf-overrides`` sets its ``max_position_embeddings`` to ``--max-positions``; a ``--max-model-len`` one past it
is checked to be refused first) and its frames kept at their size, so an 8-frame 448x448 clip is 1,024 video
tokens and 18 rotary positions. For each of ``--policies`` one server runs, one stream is opened and clips of
``--clip-frames`` frames at ``--fps`` are pushed for ``--hours`` of video as fast as the server takes them;
``none`` ends at the first 410 (``--max-model-len``, the rotary range), ``cords`` ends with a 410 when its rotary
positions run out (just after two hours with the defaults). Every ``--ask-every-min`` minutes of video it asks
about a dot shown a few seconds before and a square shown ``--old-event-min`` minutes before (see
:mod:`cords_vllm.lab.bench.stream_hours`).

Prints a summary table (KV blocks first / last, RSS growth after warm-up in % per hour of video, the ratio of the
median push time of the last 10% of pushes to the first 10%, questions right / asked, where a stream ended) and
writes ``results.json`` and ``stream_hours.png`` (KV blocks, RSS and push time against video time) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from cords_vllm.lab.bench.stream_hours import (
    HoursConfig,
    PolicyRun,
    PushRecord,
    QuestionRecord,
    StreamVideo,
    agreement_with_none,
    check_position_range,
    format_summary,
    plan_questions,
    plot_runs,
    run_policy,
    summarise,
    write_results,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=["none", "cords"])
    p.add_argument("--hours", type=float, default=2.05,
                   help="hours of video to stream (default: %(default)s: a stream of 8-frame 448x448 clips with a "
                        "question every 15 minutes reaches Qwen2-VL-7B's rotary range just after 2 hours)")
    p.add_argument("--fps", type=float, default=2.0, help="frames per second of video (default: %(default)s)")
    p.add_argument("--clip-frames", type=int, default=8, help="frames per push, even (default: %(default)s)")
    p.add_argument("--size", type=int, default=448,
                   help="frame side in pixels, a multiple of 28 (default: %(default)s)")
    p.add_argument("--ask-every-min", type=float, default=15.0,
                   help="minutes of video between checkpoints of two questions (default: %(default)s)")
    p.add_argument("--old-event-min", type=float, default=None,
                   help="how long before a checkpoint its old event is shown (default: 5, at most half of "
                        "--ask-every-min)")
    p.add_argument("--old-after-recent", action="store_true",
                   help="ask each old question after the recent event (the dot) is shown, with the recent question: "
                        "the model must tell the square from the newer dot (default: asked two pushes earlier)")
    p.add_argument("--budget", type=int, default=2048, help="cords budget, video tokens (default: %(default)s)")
    p.add_argument("--max-text-tokens", type=int, default=1024)
    p.add_argument("--max-positions", type=int, default=32768, help="max_position_embeddings served (Qwen2-VL-7B's)")
    p.add_argument("--cords-max-model-len", type=int, default=None,
                   help="--max-model-len under a policy (default: what a stream holds plus one push)")
    p.add_argument("--checkpoint", default="shipped",
                   help="'shipped' (the shipped tiny video-QA model, default), a checkpoint directory (e.g. one "
                        "fine-tuned on stream-shaped examples by train_vqa.py --stream-batch) or a Hugging Face model "
                        "id served as is (e.g. Qwen/Qwen2-VL-7B-Instruct on a GPU, with --dtype auto "
                        "--answer-tokens 16)")
    p.add_argument("--skip-range-check", action="store_true", help="do not check that the served range is refused "
                                                                   "one past --max-positions")
    p.add_argument("--mm-cache-gb", type=float, default=0.0,
                   help="vllm serve --mm-processor-cache-gb (default: 0, off: a live stream never repeats a clip, "
                        "so the cache only fills; vLLM's default is 4)")
    p.add_argument("--loop-clips", action="store_true",
                   help="repeat the same 16 background clips (default: every push unique, a timestamp in a corner)")
    p.add_argument("--dtype", default="float32",
                   help="model and KV dtype (default: %(default)s, the tiny checkpoints'; 'auto' for a served "
                        "Qwen2-VL)")
    p.add_argument("--answer-tokens", type=int, default=1,
                   help="tokens an answer may take; an answer is scored by the first colour it names (default: "
                        "%(default)s, the tiny checkpoints answer one word)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/stream_hours"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    from cords_vllm.lab.vqa import shipped_checkpoint

    old = args.old_event_min if args.old_event_min is not None else min(5.0, args.ask_every_min / 2)
    cfg = HoursConfig(hours=args.hours, fps=args.fps, clip_frames=args.clip_frames, size=args.size,
                      ask_every_min=args.ask_every_min, old_event_min=old,
                      old_after_recent=args.old_after_recent, budget=args.budget,
                      recent=args.budget // 4, slack=args.budget // 4, max_text_tokens=args.max_text_tokens,
                      max_positions=args.max_positions, cords_max_model_len=args.cords_max_model_len,
                      mm_cache_gb=args.mm_cache_gb, dtype=args.dtype, answer_tokens=args.answer_tokens,
                      seed=args.seed)
    model_dir = shipped_checkpoint() if args.checkpoint == "shipped" else args.checkpoint  # a directory or an id
    t_all = time.perf_counter()
    print(f"==> {cfg.hours:g} h of {cfg.size}x{cfg.size} video at {cfg.fps:g} fps in {cfg.pushes} pushes of "
          f"{cfg.clip_frames} frames ({cfg.clip_tokens} video tokens, {cfg.clip_positions} rotary positions each; "
          f"{cfg.pushes * cfg.clip_positions} positions of video against a range of {cfg.max_positions})", flush=True)
    range_check = None
    if not args.skip_range_check:
        range_check = check_position_range(model_dir, cfg)
        print(f"==> --max-model-len {cfg.max_positions + 1} refused: {range_check['refused']} "
              f"(derived {range_check['derived']})", flush=True)
        if not range_check["ok"]:
            print("    the served rotary range is not --max-positions: stopping", file=sys.stderr)
            return 1
    questions = plan_questions(cfg)
    video = StreamVideo(cfg, questions, unique=not args.loop_clips)
    runs: list[PolicyRun] = []
    for policy in args.policies:
        print(f"==> --kv-policy {policy}: starting vllm serve ...", flush=True)
        with tqdm(total=cfg.pushes, desc=f"    {policy}", unit="push", file=sys.stderr, mininterval=2.0) as bar:
            def progress(record: PushRecord, bar: tqdm = bar) -> None:
                bar.update(1)
                bar.set_postfix(blocks=record.pool_blocks, rss=f"{record.rss_mb:.0f}MB", s=f"{record.push_s:.2f}",
                                refresh=False)

            def answered(q: QuestionRecord, bar: tqdm = bar) -> None:
                bar.write(f"    {q.video_s / 60:6.1f} min, {q.kind:>6} ({(q.video_s - q.event_video_s):.0f} s ago): "
                          f"{q.question} -> {q.predicted!r} ({'right' if q.correct else 'wrong, ' + q.answer})")

            run = run_policy(model_dir, policy, cfg, video, questions, on_push=progress, on_question=answered)
        runs.append(run)
        end = "reached the end" if run.stopped is None else (
            f"ended at push {run.stopped_push} ({run.stopped_during}, HTTP {run.stopped_status}): {run.stopped}")
        print(f"    {len(run.records)} pushes in {run.wall_s:.0f} s (server up in {run.startup_s:.0f} s); {end}",
              flush=True)
        for line in run.errors + run.log_errors[:5]:
            print(f"    ! {line}", flush=True)
    summaries = [summarise(run, cfg) for run in runs]
    print("\n" + format_summary(summaries))
    for s in summaries:
        if s["pushes"]:
            delta = s["rss"].get("delta_mb")
            print(f"    {s['policy']}: KV blocks {s['kv_blocks_first']} -> {s['kv_blocks_last']} "
                  f"({'flat' if s['kv_flat'] else 'growing'}); RSS "
                  f"{'-' if delta is None else f'{delta:+.0f} MB'} after warm-up; ~{s['positions_last']} of "
                  f"{cfg.max_positions} rotary positions used; server CPU s per push "
                  f"{s['cpu_s_median_first10']:.2f} -> {s['cpu_s_median_last10']:.2f}; questions right by kind "
                  f"{s['questions_by_kind']}, stale answers {s['stale_answers']}")
    agreement = agreement_with_none(runs)
    for policy, a in agreement.items():
        print(f"    {policy} vs none on the {a['questions']} questions both answered: same answer {a['same_answer']}; "
              f"right {a['right']} ({policy}) and {a['none_right']} (none)")
    wall = time.perf_counter() - t_all
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"argv": sys.argv[1:], "config": asdict(cfg) | {"pushes": cfg.pushes, "clip_tokens": cfg.clip_tokens,
                                                             "clip_positions": cfg.clip_positions},
               "position_range_check": range_check, "wall_s": wall, "summaries": summaries,
               "agreement_with_none": agreement,
               "runs": [r.to_json() for r in runs]}
    write_results(args.out / "results.json", payload)
    png = plot_runs(runs, args.out / "stream_hours.png",
                    title=f"one stream, {cfg.size}x{cfg.size} at {cfg.fps:g} fps, {cfg.clip_frames}-frame pushes")
    print(f"==> wrote {args.out / 'results.json'} and {png} ({wall / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
