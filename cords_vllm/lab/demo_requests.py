"""One-shot video requests through the OpenAI client, under ``--kv-policy none`` and ``cords``.

``python -m cords_vllm.lab.demo_requests`` serves the tiny Qwen2-VL trained here on synthetic video
questions (``cords_vllm/lab/assets/tiny_vqa``, shipped with the package) twice, with ``--kv-policy none`` and
``--kv-policy cords``, each on 127.0.0.1 with the same small KV pool (room for ``--pool-videos``
uncompressed videos). The same concurrent chat requests, each a 128-frame video (1,024 video tokens) with a
question whose one-word answer sits in a few frames (the colour of a square, which of two came first, how
many flashes), go to each server through the OpenAI client. It prints every question with the right answer
and both servers' answers, then a table of KV blocks held, concurrency and throughput read from the
servers' own ``/metrics``, and stops each server by PID (checking that no process is left).

``--model random`` serves a randomly initialised tiny model instead (built and cached on first use; its
answers are noise) on larger synthetic videos.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cords_vllm.lab.bench.http import run_http
from cords_vllm.lab.bench.offline import EngineSettings, PolicyResult, prompt_tokens
from cords_vllm.lab.bench.report import format_table
from cords_vllm.lab.bench.workload import VideoWorkload, VQAWorkload
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_qwen2vl
from cords_vllm.lab.vqa import shipped_checkpoint

TABLE = [("label", "policy", "{}"), ("peak_kv_blocks", "peak KV blocks", "{}"),
         ("total_kv_blocks", "pool blocks", "{}"), ("peak_running", "peak running", "{}"),
         ("preemptions", "preemptions", "{}"), ("compressions", "compressions", "{}"),
         ("requests_per_s", "req/s", "{:.2f}"), ("ttft_p50_s", "TTFT p50 s", "{:.1f}"), ("wall_s", "wall s", "{:.1f}")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cords_vllm.lab.demo_requests", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["trained", "random"], default="trained",
                   help="the shipped video-QA model, or a random tiny model (default: %(default)s)")
    p.add_argument("--requests", type=int, default=8, help="concurrent video requests (default: %(default)s)")
    p.add_argument("--frames", type=int, default=None,
                   help="frames per video (default: 128 for the trained model, 64 for the random one)")
    p.add_argument("--size", type=int, default=224, help="frame side in pixels, random model only (default: "
                   "%(default)s; the trained model reads 112x112 frames)")
    p.add_argument("--budget", type=int, default=None,
                   help="cords budget in video tokens (default: 1/8 of a video's tokens)")
    p.add_argument("--pool-videos", type=float, default=2.0, help="KV pool size in uncompressed videos")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per answer (default: 1 for the trained model, whose answers are one word; 8)")
    p.add_argument("--policies", nargs="+", default=["none", "cords"], help="servers to run, in order")
    args = p.parse_args(argv)
    trained = args.model == "trained"
    args.frames = args.frames or (128 if trained else 64)
    args.max_tokens = args.max_tokens or (1 if trained else 8)
    return args


def build_workload(args: argparse.Namespace) -> tuple[Path, VideoWorkload | VQAWorkload]:
    """The model directory and the requests the demo sends."""
    if args.model == "trained":

        return shipped_checkpoint(), VQAWorkload(num_requests=args.requests, frames=args.frames,
                                                 max_tokens=args.max_tokens)

    print("==> building the tiny random Qwen2-VL (cached after the first run)", flush=True)
    return build_tiny_qwen2vl(TinyModelSpec()), VideoWorkload(
        num_requests=args.requests, frames=args.frames, size=args.size, max_tokens=args.max_tokens)


def serve_args(model_dir, policy: str, workload: VideoWorkload | VQAWorkload, pool_videos: float,
               budget: int) -> list[str]:
    """``vllm serve`` flags for the demo: fp32, eager, small blocks and chunks, a pool of ``pool_videos``."""
    length = prompt_tokens(model_dir, workload.requests()[0].prompt, workload)
    kw = EngineSettings(block_size=32, chunk=128, step_tokens=2048, pool_videos=pool_videos).engine_kwargs(
        model_dir, workload, length + 32)  # + chat template text
    args = ["--kv-policy", policy, "--dtype", kw["dtype"], "--enforce-eager", "--block-size", str(kw["block_size"]),
            "--kv-cache-memory-bytes", str(kw["kv_cache_memory_bytes"]), "--max-model-len", str(kw["max_model_len"]),
            "--max-num-batched-tokens", str(kw["max_num_batched_tokens"]),
            "--max-num-scheduled-tokens", str(kw["max_num_scheduled_tokens"]),
            "--long-prefill-token-threshold", str(kw["long_prefill_token_threshold"]),
            "--limit-mm-per-prompt", '{"image": 0, "video": 1}',
            "--media-io-kwargs", '{"video": {"num_frames": -1}}']  # every frame (vLLM samples 32 by default)
    if policy != "none":
        args += ["--kv-policy-config", f'{{"budget": {budget}}}']
    return args


def _print_answers(workload: VideoWorkload | VQAWorkload, results: list[PolicyResult]) -> None:
    requests = workload.requests()
    known = all(r.answer is not None for r in requests)
    if not known:
        last = results[-1]
        print(f"\n==> answers of the {last.label} server (random model: noise):")
        for r in requests:
            print(f"    {r.request_id}: {last.answers.get(r.request_id)!r}")
        return
    labels = [res.label for res in results]
    rows = [("request", "question", "answer", *labels)]
    for r in requests:
        rows.append((r.request_id, r.question, r.answer, *(str(res.answers.get(r.request_id, "")).strip()
                                                            for res in results)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    print("\n==> answers (one word each):")
    for i, row in enumerate(rows):
        print("    " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("    " + "  ".join("-" * w for w in widths))
    for res in results:
        right = sum(str(res.answers.get(r.request_id, "")).strip() == r.answer for r in requests)
        print(f"    {res.label}: {right}/{len(requests)} right")


def main(argv: list[str] | None = None) -> int:
    run_demo(parse_args(argv))
    return 0


def run_demo(args: argparse.Namespace) -> list[PolicyResult]:
    """Serve, ask and stop for each policy in ``args.policies``; print answers and the table; return results."""
    from tqdm import tqdm


    model_dir, workload = build_workload(args)
    budget = args.budget or max(32, workload.video_tokens // 8)
    print(f"==> workload: {args.requests} concurrent requests, each a {args.frames}-frame video "
          f"({workload.video_tokens} video tokens) and a question; KV pool: {args.pool_videos:g} uncompressed "
          f"videos; cords budget {budget} video tokens", flush=True)
    results: list[PolicyResult] = []
    for policy in args.policies:
        server = VLLMServer(model_dir, serve_args(model_dir, policy, workload, args.pool_videos, budget))
        t0 = time.perf_counter()
        print(f"==> vllm serve {model_dir.name} --kv-policy {policy} on {server.base_url} ...", flush=True)
        with server:
            print(f"    healthy after {time.perf_counter() - t0:.0f}s", flush=True)
            with tqdm(total=args.requests, desc=f"    {policy}", unit="req") as bar:
                results.append(run_http(server.base_url, policy, workload, on_progress=bar.update,
                                        poll_seconds=0.02))
        print(f"    server stopped (pid {server.proc.pid}, exit {server.proc.returncode})", flush=True)
    _print_answers(workload, results)
    print()
    print(format_table([r.summary() for r in results], TABLE))
    return results


if __name__ == "__main__":
    sys.exit(main())
