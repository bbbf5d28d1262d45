"""The main job in one command: live video streams into one server with ``--kv-policy cords``, then ``none``.

``python -m cords_vllm.lab.demo`` (``make demo``) serves the tiny Qwen2-VL trained here on synthetic video
questions (``cords_vllm/lab/assets/tiny_vqa``, shipped with the package) on 127.0.0.1 with a small KV pool (room
for ``--pool-streams`` uncompressed streams), and plays ``--cameras`` synthetic cameras into it at the same
time, in real time, through the stream API (``/v1/streams``, :mod:`cords_vllm.client`). Each camera shows a
held-out video whose answer sits in a few frames (the colour of a square, which of two came first, how many
flashes); a little after those frames have gone by, while the camera keeps streaming, it asks its question.
The demo prints every answer next to the right one, the KV blocks each stream holds over time (a table and
``kv_per_stream.png``), and then runs the same cameras against ``--kv-policy none`` to show where that runs
out. Every server is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cords_vllm.lab.bench.http import num_gpu_blocks
from cords_vllm.lab.bench.live import Camera, LiveRun, Question, plot_kv_per_stream, run_cameras
from cords_vllm.lab.bench.offline import kv_bytes_per_block
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.vqa import VideoGeometry, make_split, shipped_checkpoint

BLOCK = 32
#: Chat text of a stream with one question (system prompt, markers, question, answer), rounded up.
TEXT_TOKENS = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cords_vllm.lab.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--cameras", type=int, default=6, help="live streams at once (default: %(default)s)")
    p.add_argument("--frames", type=int, default=128, help="frames each camera streams (default: %(default)s)")
    p.add_argument("--fps", type=float, default=8.0, help="frames per second of each camera (default: %(default)s)")
    p.add_argument("--push-frames", type=int, default=8, help="frames per push (default: %(default)s)")
    p.add_argument("--pool-streams", type=float, default=2.0,
                   help="KV pool size, in uncompressed streams of the run's length (default: %(default)s)")
    p.add_argument("--budget", type=int, default=128, help="cords budget, video tokens (default: %(default)s)")
    p.add_argument("--policies", nargs="+", default=["cords", "none"], help="servers to run, in order")
    p.add_argument("--out", type=Path, default=Path("demo_out"), help="where the PNG and JSON go")
    args = p.parse_args(argv)
    if args.frames % args.push_frames or args.push_frames % 2:
        p.error("--frames must be a multiple of --push-frames, and --push-frames even")
    return args


def build_cameras(args: argparse.Namespace) -> list[Camera]:
    """One held-out video question per camera; each asks a couple of pushes after its answer went by."""

    families = ("colour", "order", "count", "static")
    geometry = VideoGeometry(num_frames=args.frames)
    examples = make_split(families, -(-args.cameras // len(families)), "heldout", geometry=geometry)
    examples = sorted(examples, key=lambda e: (e.index, e.family))[: args.cameras]
    pushes = args.frames // args.push_frames
    cameras = []
    for i, ex in enumerate(examples):
        last_needle = max(ex.needle_frames, default=args.frames // 2)
        after = min(pushes, last_needle // args.push_frames + 1 + 2)
        cameras.append(Camera(f"cam-{i + 1}", ex.frames, args.fps, args.push_frames,
                              (Question(after, ex.question, ex.answer),), start_delay_s=0.1 * i))
    return cameras


def stream_tokens(args: argparse.Namespace) -> int:

    geometry = VideoGeometry(num_frames=args.frames, size=getattr(args, "size", VideoGeometry().size))
    return geometry.num_video_tokens + 2 * (args.frames // args.push_frames) + TEXT_TOKENS


def serve_args(model_dir: Path, policy: str, args: argparse.Namespace) -> list[str]:
    """``vllm serve`` flags: fp32, eager, 32-token blocks, a pool of ``--pool-streams`` uncompressed streams.

    Under ``none`` ``--max-model-len`` is one stream's length (vLLM requires it to fit the pool, and the stream
    API admits a stream under ``none`` as one max-model-len request); under a policy the start-up rule asks
    the pool only for one stream's bounded footprint, so a stream may be as long as wanted.
    """
    stream_blocks = -(-stream_tokens(args) // BLOCK)
    pool_blocks = int(args.pool_streams * stream_blocks)
    kv_bytes = (pool_blocks + 1) * kv_bytes_per_block(model_dir, BLOCK, 4)
    max_model_len = stream_blocks * BLOCK if policy == "none" else 131072
    flags = ["--kv-policy", policy, "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
             "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(max_model_len),
             "--max-num-batched-tokens", "2048", "--limit-mm-per-prompt", '{"image": 0, "video": 1}',
             "--served-model-name", "tiny-vqa", "--kv-stream-max-open", str(max(64, args.cameras))]
    if policy != "none":
        config = {"budget": args.budget, "recent": args.budget // 4, "slack": args.budget // 4,
                  "max_text_tokens": 128}
        flags += ["--kv-policy-config", json.dumps(config)]
    return flags


def main(argv: list[str] | None = None) -> int:
    run_demo(parse_args(argv))
    return 0


def run_demo(args: argparse.Namespace) -> list[LiveRun]:
    """Serve each policy in turn, play the cameras, print answers, KV per stream and a summary; return runs."""
    from tqdm import tqdm


    model_dir = shipped_checkpoint()
    cameras = build_cameras(args)
    seconds = args.frames / args.fps
    print(f"==> {len(cameras)} live cameras, each streaming a {args.frames}-frame video at {args.fps:g} fps "
          f"({seconds:g} s, {stream_tokens(args) - TEXT_TOKENS} video and marker tokens) in pushes of "
          f"{args.push_frames} frames; KV pool: {args.pool_streams:g} uncompressed streams; cords budget {args.budget} "
          f"video tokens",
          flush=True)
    runs: list[LiveRun] = []
    for policy in args.policies:
        server = VLLMServer(model_dir, serve_args(model_dir, policy, args))
        t0 = time.perf_counter()
        print(f"==> vllm serve tiny_vqa --kv-policy {policy} on {server.base_url} ...", flush=True)
        with server:
            total = num_gpu_blocks(server.base_url) - 1  # block 0 is the null block
            print(f"    healthy after {time.perf_counter() - t0:.0f}s; pool {total} blocks of {BLOCK} tokens",
                  flush=True)
            with tqdm(total=sum(c.num_pushes for c in cameras), desc=f"    {policy} pushes", unit="push") as bar:
                run = run_cameras(server.base_url, cameras, policy, total_blocks=total,
                                  on_push=lambda _run: bar.update(1))
            runs.append(run)
            ended = [c for c in run.cameras if c.ended]
            print(f"    {run.sustained}/{len(cameras)} streams kept pace; {len(ended)} refused or ended early"
                  + (f"; {ended[0].camera}: {ended[0].ended}" if ended else ""), flush=True)
        print(f"    server stopped (pid {server.proc.pid}, exit {server.proc.returncode})", flush=True)
    print_answers(cameras, runs)
    print_kv_over_time(runs, seconds)
    print_summary(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot_kv_per_stream(runs, args.out / "kv_per_stream.png",
                             title=f"{len(cameras)} live cameras, pool of {args.pool_streams:g} uncompressed streams")
    (args.out / "live_streams.json").write_text(json.dumps([r.to_json() for r in runs], indent=1))
    print(f"\n==> KV per stream over time: {png}")
    return runs


def _table(rows: list[tuple]) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("    " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("    " + "  ".join("-" * w for w in widths))


def print_answers(cameras: list[Camera], runs: list[LiveRun]) -> None:
    print("\n==> questions asked mid-stream, about events earlier in the stream:")
    rows: list[tuple] = [("camera", "asked at", "question", "right", *(r.label for r in runs))]
    for cam in cameras:
        for q in cam.questions:
            cells = []
            for run in runs:
                a = next((a for c in run.cameras if c.camera == cam.name for a in c.answers if a.question == q.text),
                         None)
                cells.append("-" if a is None else (a.text.strip() if a.text is not None else f"({a.error})"[:48]))
            rows.append((cam.name, f"{q.after_push * cam.push_interval_s:.0f} s", q.text, q.answer, *cells))
    _table(rows)
    for run in runs:
        answers = run.answers
        print(f"    {run.label}: {sum(a.correct for a in answers)}/{len(answers)} right")


def print_kv_over_time(runs: list[LiveRun], seconds: float) -> None:
    print("\n==> KV blocks held per stream (mean over streams / max) and pool blocks in use, over time:")
    marks = [seconds * f for f in (0.25, 0.5, 0.75, 1.0)]
    rows: list[tuple] = [("policy", *(f"t={t:.0f}s" for t in marks))]
    for run in runs:
        cells = []
        for t in marks:
            sample = min(run.samples, key=lambda s, t=t: abs(s.t - t), default=None)
            if sample is None or not sample.blocks:
                cells.append("-")
                continue
            values = list(sample.blocks.values())
            cells.append(f"{sum(values) / len(values):.0f}/{max(values)} (pool {sample.pool_in_use})")
        rows.append((run.label, *cells))
    _table(rows)


def print_summary(runs: list[LiveRun]) -> None:
    print("\n==> summary:")
    rows: list[tuple] = [("policy", "streams kept pace", "refused/ended", "answers right", "peak blocks/stream",
                          "pool blocks", "preemptions", "worst lag s")]
    for run in runs:
        rows.append((run.label, f"{run.sustained}/{len(run.cameras)}", sum(1 for c in run.cameras if c.ended),
                     f"{sum(a.correct for a in run.answers)}/{len(run.answers)}", run.peak_blocks_per_stream(),
                     run.pool_blocks, run.preemptions(), f"{max(c.max_lag_s for c in run.cameras):.1f}"))
    _table(rows)


if __name__ == "__main__":
    sys.exit(main())
