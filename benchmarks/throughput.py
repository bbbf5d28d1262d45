"""Throughput of every KV policy on one long-video workload, measured in one run.

Offline (default): each policy runs the same requests through a fresh in-process vLLM engine whose KV pool
holds ``--pool-videos`` uncompressed videos. HTTP: the workload is sent to a running ``vllm serve`` (start
it yourself with the policy you want to measure) and the server's own ``/metrics`` are read.

    python benchmarks/throughput.py --requests 16 --frames 128 --size 448 --budget 2048
    python benchmarks/throughput.py --mode http --url http://127.0.0.1:8000 --label cords

Prints one table per run, the ratios against ``none`` (or ``--baseline``), and writes ``results.json`` plus PNG plots to
``--out``. ``--repeats N`` (offline) runs ``N`` rounds of every cell, in an order rotated each round, and reports
each cell's speed-up over the baseline round by round (median and range): one run of a few seconds moves by several
percent from run to run, so a claim of a few percent needs the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from cords_vllm.lab.bench.repeats import PAIRED_COLUMNS, median_run, paired_speedups, plot_paired, round_order
from cords_vllm.lab.bench.report import RATIO_COLUMNS, format_table, plot_results, ratios, write_json
from cords_vllm.lab.bench.workload import VideoWorkload


def _default_policies() -> list[str]:
    from cords_vllm.selection import available_selectors

    return ["none", *available_selectors(), "cords:anchors=0+2", "cords:granularity=block",
            "cords:granularity=token"]


def _machine() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                     platform.processor())
    return f"{model}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["offline", "http"], default="offline")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server for --mode http")
    p.add_argument("--label", default="server", help="name of the server's policy in --mode http")
    p.add_argument("--policies", nargs="+", default=None,
                   help="policies to compare (offline), e.g. none cords uniform 'cords:anchors=0+2,alpha=0.5'; "
                        "default: none, every registered policy and a two-anchor cords")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--frames", type=int, default=128)
    p.add_argument("--size", type=int, default=448, help="frame side in pixels (multiple of 28)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--budget", type=int, default=2048,
                   help="video tokens kept: a policy's budget, and what pruning alone (evs, vidcom2) keeps")
    p.add_argument("--family", choices=("qwen2_vl", "qwen2_5_vl"), default="qwen2_vl",
                   help="architecture of the tiny model (vLLM's video pruning needs qwen2_5_vl)")
    p.add_argument("--pool-videos", type=float, default=2.0, help="KV pool size in uncompressed videos")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--chunk", type=int, default=512, help="prefill tokens per request per step")
    p.add_argument("--step-tokens", type=int, default=4096, help="tokens per engine step")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/throughput"))
    p.add_argument("--repeats", type=int, default=1,
                   help="offline: rounds of every cell (order rotated each round); speed-ups paired by round")
    p.add_argument("--baseline", default=None,
                   help="the cell the ratios compare with (default: none, when it runs), e.g. evs for evs+cords "
                        "against evs")
    caching = p.add_mutually_exclusive_group()
    caching.add_argument("--prefix-caching", dest="prefix_caching", action="store_const", const=True, default=None,
                         help="vLLM's prefix caching asked for in every cell (default: the engine's choice, on; a "
                              "policy keeps the requests it may compress out of it)")
    caching.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_const", const=False,
                         help="vLLM's prefix caching off in every cell")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.mode == "http" and (args.baseline is not None or args.prefix_caching is not None):
        p.error("--baseline and --[no-]prefix-caching set up offline cells; --mode http measures the server as "
                "started")
    baseline = args.baseline or "none"
    if args.repeats > 1 and args.mode == "http":
        p.error("--repeats runs the offline cells; in --mode http, run the command once per server start")

    from tqdm import tqdm

    workload = VideoWorkload(num_requests=args.requests, frames=args.frames, size=args.size,
                             max_tokens=args.max_tokens, rate=args.rate,
                             fps=None if args.family == "qwen2_vl" else 2.0)
    print(f"workload: {args.requests} requests x {workload.video_tokens} video tokens "
          f"({args.frames} frames of {args.size}x{args.size}), arrivals: "
          f"{f'Poisson {args.rate:.2f}/s' if args.rate else 'all at once'}; machine: {_machine()}", flush=True)
    results = []
    rounds: list[list[dict]] = []
    if args.mode == "http":
        from cords_vllm.lab.bench.http import run_http

        with tqdm(total=args.requests, desc=args.label, unit="req") as bar:
            results.append(run_http(args.url, args.label, workload, on_progress=bar.update))
    else:
        from cords_vllm.lab.bench import pruning
        from cords_vllm.lab.bench.offline import EngineSettings, run_offline
        from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_model

        defaults = {"budget": args.budget}
        specs = [pruning.parse(text, defaults) for text in (args.policies or _default_policies())]
        if len({s.label for s in specs}) != len(specs):
            p.error("--policies names a cell twice (use --repeats to run cells again)")
        if args.baseline is not None and args.baseline not in {s.label for s in specs}:
            p.error(f"--baseline {args.baseline!r} is not one of the cells in --policies")
        max_pixels = max(224 * 224, args.size * args.size)
        model = build_tiny_model(TinyModelSpec(max_pixels=max_pixels, family=args.family))
        settings = EngineSettings(block_size=args.block_size, chunk=args.chunk, step_tokens=args.step_tokens,
                                  pool_videos=args.pool_videos, prefix_caching=args.prefix_caching)
        runs: dict[str, list] = {s.label: [] for s in specs}
        for index in range(args.repeats):
            for spec in round_order(specs, index):
                desc = spec.label if args.repeats == 1 else f"{spec.label} ({index + 1}/{args.repeats})"
                with tqdm(total=args.requests, desc=f"{desc:>20}", unit="req") as bar:
                    runs[spec.label].append(run_offline(model, spec, workload, settings, on_progress=bar.update))
            rounds.append([runs[s.label][index].summary() for s in specs])
        results = [median_run(r, [x.wall_seconds for x in r]) for r in runs.values()]
    rows = [r.summary() for r in results]
    print()
    if args.repeats > 1:
        print(f"each cell's run of median wall time, of {args.repeats}:")
    print(format_table(rows))
    ratio_rows = ratios(rows, baseline)
    if ratio_rows:
        print(f"\nagainst {baseline} (same requests, same run):" if args.repeats == 1 else
              f"\nagainst {baseline} (same requests, each cell's median run):")
        print(format_table(ratio_rows, RATIO_COLUMNS))
    paired = paired_speedups(rounds, baseline) if args.repeats > 1 else []
    if paired:
        print(f"\nagainst {baseline}, round by round ({args.repeats} rounds, speed-up = {baseline}'s "
              "wall / the cell's):")
        print(format_table(paired, PAIRED_COLUMNS))
    payload = {"machine": _machine(), "argv": sys.argv[1:], "workload": vars(workload) | {
        "video_tokens": workload.video_tokens}, "results": [r.to_json() for r in results],
        "baseline": baseline, "ratios": ratio_rows}
    if args.mode == "offline":
        payload["engine"] = dataclasses.asdict(settings)
    if args.repeats > 1:
        payload |= {"repeats": args.repeats, "rounds": rounds, "paired": paired}
    write_json(args.out / "results.json", payload)
    print(f"\nwrote {args.out / 'results.json'}")
    if not args.no_plots:
        for path in plot_results(results, args.out):
            print(f"wrote {path}")
        if paired:
            plot_paired(paired, baseline, args.out / "speedup_rounds.png")
            print(f"wrote {args.out / 'speedup_rounds.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
