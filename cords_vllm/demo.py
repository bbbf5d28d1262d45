"""The main job in one command: serve a tiny local Qwen2-VL with ``--kv-policy cords`` and answer videos.

``python -m cords_vllm.demo`` (``make demo``) builds the tiny model (cached), then for ``none`` and for
``cords`` starts ``vllm serve <tiny> --kv-policy POLICY`` on 127.0.0.1 with the same small KV pool (room for
``--pool-videos`` uncompressed videos), streams the same concurrent video requests through the OpenAI
client, prints every answer of the ``cords`` server, and stops each server by PID (checking that no process
is left). It ends with a table of KV blocks held, concurrency and throughput for ``none`` vs ``cords``,
read from the servers' own ``/metrics``.

The tiny model is randomly initialised, so its answers are noise: the point is the serving path (video over
HTTP, compression inside the engine, blocks returned to the pool), not what the model says.
"""

from __future__ import annotations

import argparse
import sys
import time

from cords_vllm.bench.offline import EngineSettings, PolicyResult
from cords_vllm.bench.report import format_table
from cords_vllm.bench.workload import VideoWorkload
from cords_vllm.testing import TinyModelSpec, build_tiny_qwen2vl
from cords_vllm.testing.server import VLLMServer

TABLE = [("label", "policy", "{}"), ("peak_kv_blocks", "peak KV blocks", "{}"),
         ("total_kv_blocks", "pool blocks", "{}"), ("peak_running", "peak running", "{}"),
         ("preemptions", "preemptions", "{}"), ("compressions", "compressions", "{}"),
         ("requests_per_s", "req/s", "{:.2f}"), ("ttft_p50_s", "TTFT p50 s", "{:.1f}"), ("wall_s", "wall s", "{:.1f}")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cords_vllm.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=6, help="concurrent video requests (default: %(default)s)")
    p.add_argument("--frames", type=int, default=64, help="frames per video (default: %(default)s)")
    p.add_argument("--size", type=int, default=224, help="frame side in pixels (default: %(default)s)")
    p.add_argument("--budget", type=int, default=512, help="cords budget in video tokens (default: %(default)s)")
    p.add_argument("--pool-videos", type=float, default=2.0, help="KV pool size in uncompressed videos")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default: %(default)s)")
    p.add_argument("--policies", nargs="+", default=["none", "cords"], help="servers to run, in order")
    return p.parse_args(argv)


def serve_args(model_dir, policy: str, workload: VideoWorkload, pool_videos: float, budget: int) -> list[str]:
    """``vllm serve`` flags for the demo: fp32, eager, small blocks and chunks, a pool of ``pool_videos``."""
    from cords_vllm.bench.offline import prompt_tokens
    from cords_vllm.bench.workload import PROMPT, QUESTION

    length = prompt_tokens(model_dir, PROMPT.format(question=QUESTION), workload)
    kw = EngineSettings(block_size=32, chunk=256, step_tokens=2048, pool_videos=pool_videos).engine_kwargs(
        model_dir, workload, length + 32)  # + chat template text
    args = ["--kv-policy", policy, "--dtype", kw["dtype"], "--enforce-eager", "--block-size", str(kw["block_size"]),
            "--kv-cache-memory-bytes", str(kw["kv_cache_memory_bytes"]), "--max-model-len", str(kw["max_model_len"]),
            "--max-num-batched-tokens", str(kw["max_num_batched_tokens"]),
            "--max-num-scheduled-tokens", str(kw["max_num_scheduled_tokens"]),
            "--long-prefill-token-threshold", str(kw["long_prefill_token_threshold"]),
            "--limit-mm-per-prompt", '{"image": 0, "video": 1}']
    if policy != "none":
        args += ["--kv-policy-config", f'{{"budget": {budget}}}']
    return args


def main(argv: list[str] | None = None) -> int:
    run_demo(parse_args(argv))
    return 0


def run_demo(args: argparse.Namespace) -> list[PolicyResult]:
    """Serve, ask and stop for each policy in ``args.policies``; print answers and the table; return results."""
    from tqdm import tqdm

    from cords_vllm.bench.http import run_http

    print("==> building the tiny Qwen2-VL (cached after the first run)", flush=True)
    model_dir = build_tiny_qwen2vl(TinyModelSpec())
    workload = VideoWorkload(num_requests=args.requests, frames=args.frames, size=args.size,
                             max_tokens=args.max_tokens)
    print(f"==> workload: {args.requests} concurrent requests, each a {args.frames}-frame video "
          f"({workload.video_tokens} video tokens) and a question; KV pool: {args.pool_videos:g} uncompressed "
          f"videos", flush=True)
    results: list[PolicyResult] = []
    for policy in args.policies:
        server = VLLMServer(model_dir, serve_args(model_dir, policy, workload, args.pool_videos, args.budget))
        t0 = time.perf_counter()
        print(f"==> vllm serve <tiny-qwen2vl> --kv-policy {policy} on {server.base_url} ...", flush=True)
        with server:
            print(f"    healthy after {time.perf_counter() - t0:.0f}s", flush=True)
            with tqdm(total=args.requests, desc=f"    {policy}", unit="req") as bar:
                results.append(run_http(server.base_url, policy, workload, on_progress=bar.update))
        print(f"    server stopped (pid {server.proc.pid}, exit {server.proc.returncode})", flush=True)
    last = results[-1]
    print(f"\n==> answers of the {last.label} server:")
    for req_id in sorted(last.answers, key=lambda r: int(r.split("-")[1])):
        print(f"    {req_id}: {last.answers[req_id]!r}")
    print()
    print(format_table([r.summary() for r in results], TABLE))
    return results


if __name__ == "__main__":
    sys.exit(main())
