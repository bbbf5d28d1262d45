"""Live streams at scale through the stream API: how many a server sustains in real time, per policy.

    python benchmarks/streams.py                                  # none and cords, 2..13 streams of 256 frames at 4 fps
    python benchmarks/streams.py --streams 2 8 --frames 128 --fps 8 --policies cords
    python benchmarks/streams.py --soak 10 --soak-workers 8       # bounded soak (loopback, stops by itself)

For each policy one ``vllm serve`` of the shipped video-QA model runs on 127.0.0.1 with a KV pool that holds
``--pool-streams`` uncompressed streams of the run's length. For each count N in ``--streams``, N cameras
stream ``--frames`` frames at ``--fps`` in pushes of ``--push-frames`` (all at once, in real time) and ask
``--questions`` questions each at random pushes (streamed answers, time to first token recorded against
the stream's age). Reports, per policy: the most streams sustained (every camera kept pace), question TTFT
p50/p90 by stream age, peak KV blocks per stream, preemptions, the ratio against ``none`` in the same run,
and pool blocks / per-stream footprint. Writes results.json and PNG plots (KV per stream over time, TTFT
vs age) to --out.

``--soak MINUTES`` instead runs :mod:`cords_vllm.lab.bench.soak` against one ``--soak-policy`` server: streams
opened, fed and closed at random with clients vanishing mid-push and mid-answer, then checks 0 server
errors, every block back, and RSS drift after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=["none", "cords"])
    p.add_argument("--streams", nargs="+", type=int, default=[2, 4, 8, 12, 13])
    p.add_argument("--frames", type=int, default=256, help="frames each stream sends (the run's length)")
    p.add_argument("--fps", type=float, default=4.0)
    p.add_argument("--push-frames", type=int, default=8)
    p.add_argument("--size", type=int, default=112, help="frame side in pixels (a multiple of 28)")
    p.add_argument("--questions", type=int, default=2, help="questions per stream, at random pushes")
    p.add_argument("--pool-streams", type=float, default=2.0)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--stall-timeout", type=float, default=20.0, help="seconds before a camera calls its stream "
                                                                      "stalled")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES")
    p.add_argument("--soak-workers", type=int, default=8)
    p.add_argument("--soak-policy", default="cords")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/streams"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.soak is not None:
        return soak(args)
    return scale(args)


def _demo_args(args: argparse.Namespace) -> argparse.Namespace:
    """The demo's server settings for this run's stream shape."""
    return argparse.Namespace(frames=args.frames, push_frames=args.push_frames, pool_streams=args.pool_streams,
                              budget=args.budget, size=args.size, cameras=max([*args.streams, args.soak_workers]))


def cameras_for(n: int, args: argparse.Namespace, rng: random.Random) -> list:
    from cords_vllm.lab.bench.live import Camera, Question
    from cords_vllm.lab.vqa import VideoGeometry, make_split

    families = ("colour", "order", "count", "static")
    geometry = VideoGeometry(num_frames=args.frames, size=args.size)
    examples = make_split(families, -(-n // len(families)), "heldout", geometry=geometry)[:n]
    pushes = args.frames // args.push_frames
    cameras = []
    for i, ex in enumerate(examples):
        at = sorted(rng.sample(range(1, pushes + 1), min(args.questions, pushes)))
        cameras.append(Camera(f"s{i + 1}", ex.frames, args.fps, args.push_frames,
                              tuple(Question(a, ex.question, ex.answer) for a in at),
                              start_delay_s=rng.uniform(0, args.push_frames / args.fps)))
    return cameras


def scale(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cords_vllm.client import StreamClient
    from cords_vllm.lab.bench.http import num_gpu_blocks
    from cords_vllm.lab.bench.live import plot_kv_per_stream, run_cameras
    from cords_vllm.lab.demo import serve_args
    from cords_vllm.lab.serving.process import VLLMServer
    from cords_vllm.lab.vqa import shipped_checkpoint

    model_dir = shipped_checkpoint()
    rng = random.Random(args.seed)
    results: dict[str, dict] = {}
    best_runs = []
    for policy in args.policies:
        server = VLLMServer(model_dir, serve_args(model_dir, policy, _demo_args(args)))
        print(f"==> {policy}: starting vllm serve ...", flush=True)
        with server:
            total = num_gpu_blocks(server.base_url) - 1
            capacity = StreamClient(server.base_url).request("GET", "/v1/streams")["capacity"]
            rows = []
            best = None
            for n in args.streams:
                cameras = cameras_for(n, args, rng)
                with tqdm(total=sum(c.num_pushes for c in cameras), desc=f"    {policy} x{n}", unit="push",
                          mininterval=1.0) as bar:
                    run = run_cameras(server.base_url, cameras, f"{policy} x{n}", total_blocks=total,
                                      stall_timeout_s=args.stall_timeout, on_push=lambda _r: bar.update(1))
                row = summarise(run, n)
                rows.append(row)
                print(f"    {n} streams: {row['kept_pace']}/{n} kept pace, peak {row['peak_blocks_per_stream']} "
                      f"blocks/stream, TTFT p50 {row['ttft_p50_s']}, preemptions {row['preemptions']}", flush=True)
                if row["kept_pace"] == n:
                    best = run
                time.sleep(1.0)
            sustained = max((r["streams"] for r in rows if r["kept_pace"] == r["streams"]), default=0)
            peak = max((r["peak_blocks_per_stream"] for r in rows), default=0)
            results[policy] = {"pool_blocks": total, "sustained": sustained, "runs": rows, "capacity": capacity,
                               "pool_over_footprint": round(total / capacity["stream_footprint_blocks"], 2),
                               "pool_over_peak": round(total / peak, 2) if peak else None}
            best_runs.append(best or run)
    report(results, args)
    plot_kv_per_stream(best_runs, args.out / "streams_kv_per_stream.png",
                       title="KV per stream, the most streams each policy sustained")
    plot_ttft_vs_age(results, args.out / "streams_ttft_vs_age.png")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "results": results}, indent=1))
    print(f"==> wrote {args.out}/results.json and PNGs")
    return 0


def summarise(run, n: int) -> dict:
    import numpy as np

    answers = [a for a in run.answers if a.ttft_s is not None]
    ttft = [a.ttft_s for a in answers]
    return {"streams": n, "kept_pace": run.sustained, "ended": [c.ended for c in run.cameras if c.ended][:3],
            "peak_blocks_per_stream": run.peak_blocks_per_stream(), "preemptions": run.preemptions(),
            "worst_lag_s": round(max(c.max_lag_s for c in run.cameras), 2),
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3) if ttft else None,
            "ttft_p90_s": round(float(np.percentile(ttft, 90)), 3) if ttft else None,
            "ttft_by_age": [(round(a.age_s, 1), round(a.ttft_s, 4)) for a in answers],
            "right": sum(a.correct for a in run.answers), "asked": len(run.answers),
            "kv_samples": [(round(s.t, 2), s.blocks, s.pool_in_use) for s in run.samples]}


def age_buckets(points: list[tuple[float, float]], buckets: int = 3) -> list[tuple[str, float, float]]:
    """``(age range, p50, p90)`` of TTFT over ``buckets`` equal slices of stream age."""
    import numpy as np

    if not points:
        return []
    top = max(a for a, _ in points) + 1e-9
    out = []
    for b in range(buckets):
        lo, hi = top * b / buckets, top * (b + 1) / buckets
        values = [t for a, t in points if lo <= a < hi]
        if values:
            out.append((f"{lo:.0f}-{hi:.0f}s", float(np.percentile(values, 50)), float(np.percentile(values, 90))))
    return out


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    print("\n==> streams sustained in real time "
          f"({args.frames} frames at {args.fps:g} fps, pool = {args.pool_streams:g} uncompressed streams):")
    base = results.get("none", {}).get("sustained")
    for policy, res in results.items():
        ratio = f", {res['sustained'] / base:.1f}x none" if base else ""
        fit = res["pool_over_footprint"]
        share = (f"; pool / admission footprint ({res['capacity']['stream_footprint_blocks']} blocks) = "
                 f"{fit:.1f} streams: {100 * res['sustained'] / fit:.0f}% sustained")
        if res["pool_over_peak"]:
            share += f"; pool / measured peak per stream = {res['pool_over_peak']:.1f} streams"
        print(f"    {policy:>8}: {res['sustained']} streams{ratio}{share}")
        for row in res["runs"]:
            points = [tuple(p) for p in row["ttft_by_age"]]
            ages = "; ".join(f"{r} p50 {p50:.3f} p90 {p90:.3f}" for r, p50, p90 in age_buckets(points))
            print(f"        x{row['streams']:>2}: kept pace {row['kept_pace']:>2}, "
                  f"peak {row['peak_blocks_per_stream']:>3} blocks/stream, preemptions {row['preemptions']}, "
                  f"worst lag {row['worst_lag_s']} s, TTFT by age: {ages or '-'}")


def plot_ttft_vs_age(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, res in results.items():
        sustained = [r for r in res["runs"] if r["kept_pace"] == r["streams"]]
        row = sustained[-1] if sustained else res["runs"][0]
        pts = row["ttft_by_age"]
        if pts:
            ax.scatter([a for a, _ in pts], [t for _, t in pts], s=12, label=f"{policy} x{row['streams']}")
    ax.set_xlabel("stream age when asked (s)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Question latency vs stream age")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def soak(args: argparse.Namespace) -> int:
    from cords_vllm.lab.bench.http import num_gpu_blocks
    from cords_vllm.lab.bench.soak import run_soak
    from cords_vllm.lab.demo import serve_args
    from cords_vllm.lab.serving.process import VLLMServer
    from cords_vllm.lab.synthetic import make_video
    from cords_vllm.lab.vqa import shipped_checkpoint

    model_dir = shipped_checkpoint()
    idle = 10.0
    flags = [*serve_args(model_dir, args.soak_policy, _demo_args(args)), "--kv-stream-idle-timeout", str(idle)]
    clips = [make_video(args.push_frames, args.size, args.size, seed=s).frames for s in range(16)]
    server = VLLMServer(model_dir, flags)
    print(f"==> soak: {args.soak:g} min, {args.soak_workers} clients, --kv-policy {args.soak_policy}", flush=True)
    with server:
        total = num_gpu_blocks(server.base_url) - 1
        t0 = time.monotonic()
        opened = [0]

        def progress(_event: str) -> None:
            opened[0] += 1
            if opened[0] % 20 == 0:
                print(f"    {time.monotonic() - t0:6.0f} s: {opened[0]} streams opened", flush=True)

        result = run_soak(server.base_url, minutes=args.soak, workers=args.soak_workers,
                          frames=lambda rng: clips[rng.randrange(len(clips))], server_pid=server.proc.pid,
                          total_blocks=total, idle_timeout_s=idle, seed=args.seed, on_event=progress)
        log = Path(server._log.name).read_text(errors="replace")
    log_errors = [line for line in log.splitlines() if re.search(r"\bERROR\b", line) or line.startswith("Traceback")]
    out = result.to_json()
    out["server_log_errors"] = log_errors[:20]
    (args.out / "soak.json").write_text(json.dumps(out, indent=1))
    rss = [m for _, m in result.rss_mb]
    print(f"==> soak done: {result.streams} streams, {result.pushes} pushes, {result.questions} questions; "
          f"endings {dict(result.endings)}")
    print(f"    server errors (5xx): {result.server_errors}; error lines in the server log: {len(log_errors)}")
    print(f"    client-side errors: {dict(result.client_errors) or 'none'}")
    print(f"    KV blocks in use at the end: {result.blocks_in_use_at_end} of {total}")
    if rss:
        print(f"    server RSS: {rss[0]:.0f} MB at start, {max(rss):.0f} MB peak, {rss[-1]:.0f} MB at the end; "
              f"drift after warm-up {result.rss_drift_mb():+.0f} MB")
        quarter = len(result.rss_by_process) // 4
        if quarter:
            early, late = result.rss_by_process[quarter][1], result.rss_by_process[-1][1]
            for name in late:
                print(f"      {name}: {early.get(name, 0.0):.0f} MB after warm-up -> {late[name]:.0f} MB at the end")
    ok = result.server_errors == 0 and not log_errors and result.blocks_in_use_at_end == 0
    print("    PASS" if ok else "    FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
