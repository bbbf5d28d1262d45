"""Serving at a 7B model's shapes on one GPU: live streams kept in real time, what compressing costs, one-shot videos.

    bash scripts/gpu-bench.sh                 # GPU host (vLLM's CUDA build importable): the whole plan, ~7 min
    bash scripts/gpu-bench.sh --cpu           # the same steps on the CPU build at a scaled-down shape (~5 min)
    python benchmarks/gpu_bench.py --quick    # CPU: the one-minute subset (cords only, one level)

No weights are read: each cell serves a weightless model directory at the published shapes
(:mod:`cords_vllm.lab.synthetic.dummy_model`: Qwen2-VL-7B, and Qwen2.5-VL-7B for the ``evs+cords`` cell) with
``vllm serve DIR --load-format dummy``. The answers are meaningless; prefill, decode, KV, compression and memory
cost what the real model's do. Per cell (``none``, ``cords``, ``evs+cords``), one server, under the policy's
defaults and the budget given:

1. **one-shot long videos**: ``--oneshot`` requests of that many 448 x 448 frames at once (streamed chat
   completions): throughput, TTFT p50/p90, compressions;
2. **live streams** (``none`` and ``cords``; :mod:`cords_vllm.lab.bench.ramp`): 448 x 448 cameras at ``--fps``
   in pushes of ``--push-frames``, the count raised level by level (``--levels``), each level measured over
   ``--window`` s: late pushes, the plugin's share of the wall clock spent compressing and its device time per
   compression (CUDA events on a GPU), the pool's use, and the p50/p99 inter-token latency of a chat request
   running beside the cameras. The level below the first that falls behind is held ``--hold`` s; what ran out
   first (KV pool, GPU compute, API server's CPU, the client's CPU) is named.
   Under ``cords`` each camera first pre-rolls its budget's worth of frames, so that every later push compresses
   (its steady state); ``none`` has no steady state and starts empty, which favours it.

Then **the pure compress step** at Qwen2-VL-7B's cache (``benchmarks/compress_step.py``: frame, block, token and
``auto``; wall per compression, launches, host syncs, copy floor), last, so that a run cut short keeps the serving
rows. Prints one table and writes ``gpu_bench.json`` and ``gpu_bench.md`` to ``--out``: on a GPU
``benchmarks/results/gpu_bench/`` (the README's GPU section is written from it). ``--time-limit`` bounds the whole
run: a phase that would not fit is skipped and said so.

The targets (H100-class GPU, 7B shapes, the defaults): compressing <= 5% of GPU time at 64 live streams, p99
inter-token latency + <= 2 ms beside compressing streams (``cords`` against ``none`` at the same count),
``cords`` >= 5x the live streams of ``none``; the step's own targets are ``compress_step.py``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
#: Frames are 448 x 448: 256 tokens a frame pair at the 7B models' processor.
SIZE = 448
TOKENS_PER_FRAME_PAIR = 256
#: A cell that only runs the one-shot videos gets this share of the time a ramped cell gets.
ONESHOT_WEIGHT = 0.25
#: vLLM's EVS rate in the ``evs+<policy>`` cell (the benchmarks' rate before a policy).
PRUNING_RATE = 0.5


@dataclass(frozen=True)
class Plan:
    """One run's sizes: the GPU's, the CPU's scaled-down ones, or the one-minute subset's."""

    name: str
    scaled_down: bool
    dtype: str
    budget: int
    levels: tuple[int, ...]
    window_s: float
    hold_s: float
    oneshot_requests: int
    oneshot_frames: int
    fps: float = 2.0
    push_frames: int = 8
    max_model_len: int = 32768
    server_flags: tuple[str, ...] = ()
    step_args: tuple[str, ...] = ()
    time_limit_s: float = 420.0
    step_reserve_s: float = 90.0  # kept for the pure compress step, which runs last
    cell_min_s: float = 60.0  # a cell is not started with less time than this left
    startup_timeout_s: float = 600.0
    policies: tuple[str, ...] = ("cords", "none", "evs+cords")
    ramped: tuple[str, ...] = ("cords", "none")
    cores: float | None = None


PLANS: dict[str, Plan] = {
    "gpu": Plan("gpu", False, "bfloat16", budget=6144, levels=(16, 32, 64, 96, 128, 192, 256), window_s=8,
                hold_s=100, oneshot_requests=16, oneshot_frames=128, time_limit_s=480,
                server_flags=("--gpu-memory-utilization", "0.9", "--max-num-seqs", "512"),
                step_args=("--device", "cuda", "--repeats", "5")),
    "cpu": Plan("cpu", True, "float32", budget=512, levels=(1, 2, 4), window_s=6, hold_s=10, oneshot_requests=2,
                oneshot_frames=8, max_model_len=16384, time_limit_s=900, step_reserve_s=30, push_frames=4, fps=2.0,
                server_flags=("--enforce-eager", "--kv-cache-memory-bytes", str(96 << 20), "--max-num-seqs", "8"),
                step_args=("--device", "cpu", "--quick", "--repeats", "1", "--kernels", "torch"),
                cores=float(len(os.sched_getaffinity(0)))),
}
PLANS["quick"] = replace(PLANS["cpu"], name="quick", levels=(1,), window_s=5, hold_s=5, oneshot_requests=1,
                         oneshot_frames=4, policies=("cords",), ramped=("cords",), time_limit_s=240)


@dataclass
class Cell:
    """One policy's server and what it measured."""

    label: str
    shape: str
    flags: list[str]
    oneshot: dict[str, Any] | None = None
    ramp: dict[str, Any] | None = None
    startup_s: float | None = None
    skipped: list[str] = field(default_factory=list)
    error: str | None = None


def policy_flags(label: str, plan: Plan) -> tuple[str, list[str]]:
    """``(dummy shape, vllm serve flags)`` of a cell: ``none``, a policy, or ``evs+<policy>`` (Qwen2.5-VL)."""
    method, plus, policy = label.partition("+")
    shape, flags = "qwen2-vl-7b", []
    if plus:
        if method != "evs":
            raise ValueError(f"unknown pruning {method!r} in {label!r} (only evs+<policy>)")
        shape, flags, label = "qwen2.5-vl-7b", ["--video-pruning-rate", str(PRUNING_RATE)], policy
    flags += ["--kv-policy", label]
    if label != "none":
        flags += ["--kv-policy-config", json.dumps({"budget": plan.budget})]
    return shape, flags


def server_flags(plan: Plan) -> list[str]:
    """What every cell's server gets: weightless load, the dtype, the context, and room for many streams."""
    return ["--load-format", "dummy", "--dtype", plan.dtype, "--max-model-len", str(plan.max_model_len),
            "--media-io-kwargs", json.dumps({"video": {"num_frames": -1}}), "--kv-stream-max-open", "1024",
            "--kv-stream-idle-timeout", "3600", *plan.server_flags]


def write_models(plan: Plan, out: Path) -> dict[str, Path]:
    """The weightless directories the cells serve (scaled down on CPU)."""
    from cords_vllm.lab.synthetic.dummy_model import SCALED_DOWN, write_dummy_model

    models = {}
    for shape in sorted({policy_flags(p, plan)[0] for p in plan.policies}):
        overrides = SCALED_DOWN[shape] if plan.scaled_down else {}
        models[shape] = write_dummy_model(out / "models" / shape, shape, dtype=plan.dtype, **overrides)
    return models


def oneshot(base_url: str, label: str, plan: Plan) -> dict[str, Any]:
    from cords_vllm.lab.bench.http import run_http
    from cords_vllm.lab.bench.workload import VideoWorkload

    workload = VideoWorkload(num_requests=plan.oneshot_requests, frames=plan.oneshot_frames, size=SIZE,
                             max_tokens=16, fps=plan.fps)
    rate = PRUNING_RATE if "+" in label else 0.0  # EVS keeps about 1 - rate of the video's tokens
    result = run_http(base_url, label, workload, min_prompt_tokens=int(0.9 * (1 - rate) * workload.video_tokens))
    summary = result.summary()
    return {key: summary[key] for key in ("requests_per_s", "prefill_tok_per_s", "output_tok_per_s", "ttft_p50_s",
                                          "ttft_p90_s", "peak_running", "preemptions", "compressions",
                                          "selection_share", "wall_s")} | {"video_tokens": workload.video_tokens}


def ramp(server: Any, label: str, plan: Plan, deadline: float) -> dict[str, Any]:
    from cords_vllm.client import StreamClient
    from cords_vllm.lab.bench.ramp import ChatProbe, Fleet, Meter, ProcessCPU, run_ramp
    from cords_vllm.lab.synthetic import make_video

    base = make_video(16, SIZE, SIZE, seed=7).frames
    preroll = 0 if label == "none" else -(-2 * plan.budget // (TOKENS_PER_FRAME_PAIR * plan.push_frames))
    fleet = Fleet(server.base_url, base, fps=plan.fps, push_frames=plan.push_frames, preroll_pushes=preroll,
                  stall_timeout_s=max(60.0, 4 * plan.push_frames / plan.fps))
    cpus = {"api_server": ProcessCPU(server.proc.pid), "engine": ProcessCPU(server.proc.pid, children=True),
            "client": ProcessCPU(os.getpid())}
    capacity = StreamClient(server.base_url).request("GET", "/v1/streams")["capacity"]
    try:
        with ChatProbe(server.base_url) as probe:
            result = run_ramp(fleet, Meter(server.base_url, fleet, probe, cpus), plan.levels, window_s=plan.window_s,
                              hold_s=plan.hold_s, deadline=deadline, cores=plan.cores,
                              log=lambda line: print(f"  [{label}] {line}", flush=True))
    finally:
        fleet.close()
    return result.to_json() | {"capacity": capacity, "chat_errors": probe.errors[:5]}


def run_cell(label: str, plan: Plan, models: dict[str, Path], deadline: float) -> Cell:
    from cords_vllm.lab.serving.process import VLLMServer

    shape, flags = policy_flags(label, plan)
    cell = Cell(label, shape, [*server_flags(plan), *flags])
    started = time.monotonic()
    print(f"# {label}: vllm serve {shape} {' '.join(flags)}", flush=True)
    try:
        with VLLMServer(models[shape], cell.flags, startup_timeout=plan.startup_timeout_s) as server:
            cell.startup_s = round(time.monotonic() - started, 1)
            cell.oneshot = oneshot(server.base_url, label, plan)
            print(f"  [{label}] one-shot: {cell.oneshot['requests_per_s']:.3f} req/s, TTFT p50 "
                  f"{cell.oneshot['ttft_p50_s']:.2f} s", flush=True)
            if label in plan.ramped:
                cell.ramp = ramp(server, label, plan, deadline)
    except Exception as exc:  # one cell's failure is reported, the others still run
        cell.error = f"{type(exc).__name__}: {exc}"[-3000:]
        print(f"  [{label}] FAILED: {cell.error}", flush=True)
    return cell


def step(plan: Plan, out: Path) -> dict[str, Any]:
    """The pure compress step (``benchmarks/compress_step.py``) at this plan's shape."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compress_step_benchmark", ROOT / "benchmarks" / "compress_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    status = module.main([*plan.step_args, "--out", str(out / "compress_step")])
    payload = json.loads((out / "compress_step" / "compress_step.json").read_text())
    return {"status": status, "rows": [{k: r[k] for k in ("case", "kernels", "wall_ms", "launches", "syncs",
                                                          "floor_ms", "same_ids")} for r in payload["rows"]],
            "targets": payload.get("targets", [])}


def itl_delta(cells: dict[str, Cell], streams: int) -> dict[str, Any] | None:
    """p99 inter-token latency beside ``streams`` compressing streams (``cords``) against as many that are not
    (``none``), at the largest level both measured at or below ``streams``."""
    levels = {label: {lv["streams"]: lv for lv in (cell.ramp or {}).get("levels", [])}
              for label, cell in cells.items()}
    if "cords" not in levels or "none" not in levels:
        return None
    common = [n for n in levels["cords"] if n in levels["none"] and n <= streams]
    if not common:
        return None
    n = max(common)
    c, o = levels["cords"][n], levels["none"][n]
    if c["itl_p99_ms"] is None or o["itl_p99_ms"] is None:
        return None
    return {"streams": n, "cords_p99_ms": c["itl_p99_ms"], "none_p99_ms": o["itl_p99_ms"],
            "added_ms": c["itl_p99_ms"] - o["itl_p99_ms"], "cords_p50_ms": c["itl_p50_ms"],
            "none_p50_ms": o["itl_p50_ms"]}


def targets(cells: dict[str, Cell], plan: Plan) -> list[dict[str, Any]]:
    """The issue's serving targets, PASS / MISS, or ``None`` where this run cannot judge (CPU, or not measured)."""
    rows = []
    on_gpu = plan.name == "gpu"
    cords = getattr(cells.get("cords"), "ramp", None) or {}
    none = getattr(cells.get("none"), "ramp", None) or {}
    at64 = next((lv for lv in cords.get("levels", []) if lv["streams"] == 64), None)
    rows.append({"target": "compressing <= 5% of GPU time at 64 live streams",
                 "value": None if at64 is None else f"{100 * at64['compress_share']:.1f}%",
                 "pass": None if at64 is None or not on_gpu else at64["compress_share"] <= 0.05})
    delta = itl_delta(cells, 64)
    rows.append({"target": "p99 inter-token latency beside compressing streams + <= 2 ms",
                 "value": None if delta is None else f"{delta['added_ms']:+.1f} ms at {delta['streams']} streams",
                 "pass": None if delta is None or not on_gpu else delta["added_ms"] <= 2.0})
    held = (cords.get("held") or 0, none.get("held") or 0)
    rows.append({"target": "cords >= 5x the live streams of none",
                 "value": f"{held[0]} vs {held[1]}" if cords and none else None,
                 "pass": None if not (cords and none and on_gpu) else held[0] >= 5 * max(held[1], 1)})
    return rows


def markdown(payload: dict[str, Any]) -> str:
    lines = [f"# Serving at 7B shapes: {payload['machine']['device']} ({payload['plan']['name']} plan, "
             f"{payload['date']})", "",
             "| cell | one-shot req/s | TTFT p50 s | live streams held | knee | ran out first | compress share at "
             "32 / 64 | ms per compression | chat ITL p50 / p99 ms (at 32) |", "|" + "---|" * 9]
    for label, cell in payload["cells"].items():
        one, rp = cell.get("oneshot") or {}, cell.get("ramp") or {}
        levels = {lv["streams"]: lv for lv in rp.get("levels", [])}

        def share(n: int, levels: dict = levels) -> str:
            return f"{100 * levels[n]['compress_share']:.1f}%" if n in levels else "-"

        mpc = [lv["ms_per_compression"] for lv in rp.get("levels", []) if lv["ms_per_compression"]]
        at = levels.get(32) or (levels[max(levels)] if levels else None)
        itl = f"{at['itl_p50_ms'] or 0:.1f} / {at['itl_p99_ms'] or 0:.1f}" if at else "-"
        lines.append(f"| {label} | {one.get('requests_per_s', 0):.3f} | {one.get('ttft_p50_s', 0):.2f} | "
                     f"{rp.get('held', '-')} | {rp.get('knee', '-')} | {rp.get('limit') or '-'} | "
                     f"{share(32)} / {share(64)} | {(sum(mpc) / len(mpc)) if mpc else 0:.2f} | {itl} |"
                     + (f" error: {cell['error'][:200]}" if cell.get("error") else ""))
    if payload.get("step"):
        lines += ["", "Pure compress step (compress_step.py): case, kernels, wall ms, launches, syncs, copy floor ms",
                  ""] + [f"- {r['case']} / {r['kernels']}: {r['wall_ms']:.2f} ms, {r['launches']} launches, "
                         f"{r['syncs']} syncs, floor {r['floor_ms']:.3f} ms" for r in payload["step"]["rows"]]
    lines += ["", "Targets:", ""] + [f"- {t['target']}: {t['value'] or 'not measured'} -> "
                                     f"{ {True: 'PASS', False: 'MISS', None: 'not judged'}[t['pass']]}"
                                     for t in payload["targets"]]
    return "\n".join(lines) + "\n"


def machine() -> dict[str, Any]:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86'})"
    return {"device": device, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", choices=sorted(PLANS), default=None,
                   help="gpu (default where CUDA is available), cpu (scaled-down shape), quick (one-minute subset)")
    p.add_argument("--quick", action="store_true", help="the quick plan")
    p.add_argument("--policies", nargs="+", default=None, help="cells (default: none cords evs+cords)")
    p.add_argument("--levels", nargs="+", type=int, default=None, help="live stream counts to try, in order")
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--hold", type=float, default=None, help="seconds the knee's count is held")
    p.add_argument("--window", type=float, default=None, help="seconds each level is measured")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole run")
    p.add_argument("--no-step", action="store_true", help="skip the pure compress step")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    if args.quick and args.plan:
        p.error("--quick is a plan of its own: give --quick or --plan")
    name = "quick" if args.quick else args.plan or ("gpu" if torch.cuda.is_available() else "cpu")
    plan = PLANS[name]
    if name == "gpu" and not torch.cuda.is_available():
        p.error("the gpu plan needs CUDA; use --plan cpu on this machine")
    changes = {k: v for k, v in {"policies": tuple(args.policies or ()), "levels": tuple(args.levels or ()),
                                 "budget": args.budget, "hold_s": args.hold, "window_s": args.window,
                                 "time_limit_s": args.time_limit}.items() if v}
    if "policies" in changes:
        changes["ramped"] = tuple(x for x in changes["policies"] if "+" not in x)
    plan = replace(plan, **changes)
    for label in plan.policies:  # every cell's name checked before any server starts
        try:
            policy_flags(label, plan)
        except ValueError as exc:
            p.error(str(exc))
    if min(plan.window_s, plan.hold_s) < 2 * plan.push_frames / plan.fps:
        p.error(f"--window and --hold must span at least two pushes ({2 * plan.push_frames / plan.fps:g} s)")
    if any(n < 1 for n in plan.levels) or list(plan.levels) != sorted(set(plan.levels)):
        p.error(f"--levels must be increasing counts >= 1, got {list(plan.levels)}")
    out = args.out or (ROOT / "benchmarks" / ("results/gpu_bench" if name == "gpu" else f"out/gpu_bench_{name}"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + plan.time_limit_s
    cells_deadline = deadline - (0.0 if args.no_step else plan.step_reserve_s)
    print(f"# gpu_bench: {name} plan, cells {', '.join(plan.policies)}, limit {plan.time_limit_s:.0f} s", flush=True)
    models = write_models(plan, out)
    cells: dict[str, Cell] = {}
    for i, label in enumerate(plan.policies):
        remaining = cells_deadline - time.monotonic()
        if remaining < plan.cell_min_s:
            cells[label] = Cell(label, policy_flags(label, plan)[0], [], skipped=["time limit: not started"])
            print(f"# {label}: skipped (time limit)", flush=True)
            continue
        # each cell's deadline: its share of what remains (a ramped cell weighs 1, a one-shot cell ONESHOT_WEIGHT)
        weights = [1.0 if x in plan.ramped else ONESHOT_WEIGHT for x in plan.policies[i:]]
        cells[label] = run_cell(label, plan, models, time.monotonic() + remaining * weights[0] / sum(weights))
    payload: dict[str, Any] = {
        "plan": dataclasses.asdict(plan), "machine": machine(), "date": time.strftime("%Y-%m-%d"),
        "cells": {k: c.__dict__ for k, c in cells.items()}, "itl_delta": {n: itl_delta(cells, n) for n in (32, 64)}}
    if not args.no_step and time.monotonic() < deadline:
        payload["step"] = step(plan, out)
    elif not args.no_step:
        payload["step_skipped"] = "time limit reached"
    payload["targets"] = targets(cells, plan)
    payload["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "gpu_bench.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    table = markdown(payload)
    (out / "gpu_bench.md").write_text(table)
    print(table, flush=True)
    print(f"wrote {out / 'gpu_bench.json'} in {payload['wall_s']:.0f} s", flush=True)
    return 1 if any(c.error for c in cells.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
