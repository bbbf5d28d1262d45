"""A live stream far longer than the KV pool: held blocks and push cost against stream length, per policy.

One camera pushes short clips into one engine session (an in-process vLLM engine, a small KV pool). Under
``none`` the stream ends where vLLM must (a session holds at most ``--max-model-len`` tokens, and the
pool must hold one such request); under ``cords`` the pool only holds the stream's bounded footprint and
the stream runs to ``--pools`` times the pool with flat blocks.

    python benchmarks/session_length.py --pools 20

Prints held blocks and push time along the stream, a summary with the ratio of push time at the end to
the start, and writes ``results.json`` plus ``session_blocks.png`` / ``session_push_time.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from cords_vllm.lab.bench.report import write_json
from cords_vllm.lab.bench.sessions import PushRecord, plot_runs, run_session, summary
from cords_vllm.lab.bench.workload import PolicySpec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=["none", "cords"])
    p.add_argument("--pools", type=float, default=20.0, help="stream length in KV pools (video tokens)")
    p.add_argument("--pool-blocks", type=int, default=32)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--clip-frames", type=int, default=4, help="frames per push (2 frames = 1 temporal patch)")
    p.add_argument("--size", type=int, default=224, help="frame side in pixels (224: 64 tokens per patch)")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--max-text-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/session_length"))
    args = p.parse_args(argv)

    from tqdm import tqdm

    from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_qwen2vl, video_tokens

    model = build_tiny_qwen2vl(TinyModelSpec())
    clip_tokens = video_tokens(args.clip_frames, args.size, args.size)
    pool_tokens = args.pool_blocks * args.block_size
    pushes = int(args.pools * pool_tokens / clip_tokens) + 1
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for name in args.policies:
        spec = PolicySpec.parse(name, {"budget": args.budget, "max_text_tokens": args.max_text_tokens})
        # none: vLLM's start-up check ties max-model-len to the pool; a policy: what a stream holds plus one push
        # (it is re-based at every push), here the pool too
        max_len = pool_tokens
        with tqdm(total=pushes, desc=spec.label, unit="push", file=sys.stderr) as bar:
            def progress(record: PushRecord, bar=bar) -> None:
                bar.update(1)
                bar.set_postfix(blocks=record.held_blocks, s=f"{record.seconds:.2f}")

            run = run_session(model, spec, pushes=pushes, clip_frames=args.clip_frames, size=args.size,
                              pool_blocks=args.pool_blocks, block_size=args.block_size, max_model_len=max_len,
                              on_push=progress)
        runs.append(run)
        print(f"\n{spec.label}: pool {args.pool_blocks} blocks x {args.block_size} tokens, clip {clip_tokens} "
              f"video tokens, max-model-len {max_len}")
        print("| push | stream (video tokens) | stream / pool | held blocks | push s |\n|---|---|---|---|---|")
        step = max(1, len(run.records) // 10)
        for r in run.records[::step] + run.records[-1:]:
            print(f"| {r.push} | {r.stream_tokens} | {r.stream_tokens / pool_tokens:.1f} | {r.held_blocks} | "
                  f"{r.seconds:.3f} |")
        if run.stopped:
            print(f"stopped at {run.stopped}")
    summaries = [summary(r) for r in runs]
    print("\n| policy | pushes | stream / pool | peak held blocks | push s (start) | push s (end) | end / start |")
    print("|---|---|---|---|---|---|---|")
    for s in summaries:
        if s["pushes"]:
            print(f"| {s['label']} | {s['pushes']} | {s['stream_in_pools']:.1f} | {s['peak_held_blocks']} | "
                  f"{s['push_s_start']:.3f} | {s['push_s_end']:.3f} | {s['push_cost_growth']:.2f}x |")
    write_json(args.out / "results.json", {"summaries": summaries, "runs": [r.to_json() for r in runs]})
    for path in plot_runs(runs, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
