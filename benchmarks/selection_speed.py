"""Speed of the selection library: CoRDS per granularity and novelty variant, against two floors.

For every configuration (tokens ``N``, KV heads x head dim, budget, granularity, novelty) this times one
``select`` call on bf16 keys/values (what the engine reads back from its cache), including the fp32
layout copy, validation and centroids, and reports:

* ``ms``: wall time of one call (median of ``--repeats``); token rows marked ``*`` are extrapolated from
  ``--max-token-steps`` greedy steps (a max-cosine step costs the same at every ``t``, so time is linear
  in ``b``; an exact-novelty step gets cheaper once the span saturates after ``H x D`` picks, so its
  extrapolation from the first steps is an over-estimate);
* ``ms/step``: time per greedy step;
* ``GB/s``: feature bytes a step must read (``M x F`` fp32, ``M`` units, ``F = 2 x H x D``) per second;
* ``x floor``: time over the memory-copy floor, ``steps x step bytes / copy bandwidth``, the bandwidth
  being measured on this machine by copying a large fp32 buffer (bytes copied per second);
* ``naive x``: time of a from-scratch implementation (every step recomputes all distances to all
  selected units and the exact projector, vectorised) over the fast one; ``-`` where it would run for
  more than a few seconds (it is ``O(b^2 M F)``).

Usage: ``python benchmarks/selection_speed.py [--quick] [--threads 1] [--out benchmarks/results/x.md]``.
Not a test: numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cords_vllm.selection import get_selector


@dataclass(frozen=True)
class Config:
    n_tokens: int
    heads: int
    head_dim: int
    budget: int
    granularity: str
    group_size: int | None
    novelty: str


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown CPU"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time in seconds of ``fn`` after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, n_bytes: int = 256 << 20, repeats: int = 7) -> float:
    """Bytes copied per second by ``dst.copy_(src)`` on an fp32 buffer much larger than the caches."""
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return n_bytes / timed(lambda: dst.copy_(src), device, repeats)


def naive_cords(feats: torch.Tensor, key_dim: int, k: int, *, alpha: float, eta: float, lam: float,
                eps0: float, novelty: str) -> list[int]:
    """From-scratch greedy CoRDS on one problem ``[M, F]`` (timing reference, vectorised per step)."""
    keys, values = feats[:, :key_dim], feats[:, key_dim:]
    chosen = [int(torch.linalg.vector_norm(keys + values, dim=-1).argmax())]
    pool = torch.ones(feats.shape[0], dtype=torch.bool, device=feats.device)
    pool[chosen[0]] = False
    kn = torch.nn.functional.normalize(keys, dim=-1)
    vn = torch.nn.functional.normalize(values, dim=-1)

    def minmax(x: torch.Tensor) -> torch.Tensor:
        lo, hi = x[pool].min(), x[pool].max()
        return (x - lo) / (hi - lo + eps0)

    while len(chosen) < k:
        idx = torch.tensor(chosen, device=feats.device)
        ks, vs = keys[idx], values[idx]
        d = (alpha * torch.cdist(keys, ks) ** 2 + (1 - alpha) * torch.cdist(values, vs) ** 2).min(-1).values
        if novelty == "exact":
            pk = ks.T @ torch.linalg.pinv(ks.T)
            pv = vs.T @ torch.linalg.pinv(vs.T)
            orth = eta * ((keys - keys @ pk) ** 2).sum(-1) + (1 - eta) * ((values - values @ pv) ** 2).sum(-1)
        else:
            max_cos_k = (kn @ kn[idx].T).max(-1).values
            max_cos_v = (vn @ vn[idx].T).max(-1).values
            orth = eta * (1 - max_cos_k) + (1 - eta) * (1 - max_cos_v)
        score = (minmax(d) + lam * minmax(orth)).masked_fill(~pool, float("-inf"))
        j = int(score.argmax())
        chosen.append(j)
        pool[j] = False
    return chosen


def run_config(cfg: Config, device: torch.device, repeats: int, max_token_steps: int, bandwidth: float,
               naive_budget_s: float) -> dict:
    g = torch.Generator().manual_seed(0)
    shape = (1, cfg.heads, cfg.n_tokens, cfg.head_dim)
    keys = torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16)
    values = torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16)
    sel = get_selector("cords", novelty=cfg.novelty)
    group = cfg.group_size or 1
    units = cfg.n_tokens // group
    steps = cfg.budget // group
    run_budget, extrapolated = cfg.budget, False
    if cfg.granularity == "token" and steps > max_token_steps:
        run_budget, extrapolated = max_token_steps, True
    call = lambda: sel.select(keys, values, run_budget, granularity=cfg.granularity,  # noqa: E731
                              group_size=cfg.group_size)
    t_run = timed(call, device, repeats if not extrapolated else 1)
    # Extrapolate from the per-step slope between a short and the capped run (removes the fixed cost).
    if extrapolated:
        short = max(run_budget // 8, 2)
        t_short = timed(lambda: sel.select(keys, values, short, granularity="token"), device, 1)
        per_step = (t_run - t_short) / (run_budget - short)
        total = t_short + per_step * (steps - short)
    else:
        total = t_run
        per_step = t_run / max(steps, 1)
    feat_bytes = units * 2 * cfg.heads * cfg.head_dim * 4
    floor = steps * feat_bytes / bandwidth
    row = dict(cfg=cfg, units=units, steps=steps, ms=total * 1e3, extrapolated=extrapolated,
               ms_step=per_step * 1e3, gbs=feat_bytes / per_step / 1e9 if per_step > 0 else float("nan"),
               x_floor=total / floor if floor > 0 else float("nan"), naive=None, agree=None)

    # From-scratch reference where it stays cheap: O(steps^2 * units * F) multiply-adds.
    naive_flops = steps * steps / 2 * units * 2 * cfg.heads * cfg.head_dim * 4
    if naive_flops / 5e9 < naive_budget_s and steps >= 2:
        from cords_vllm.selection.granularity import candidate_ranks, group_centroids, group_ids

        feats = torch.cat([keys.permute(0, 2, 1, 3).reshape(1, cfg.n_tokens, -1),
                           values.permute(0, 2, 1, 3).reshape(1, cfg.n_tokens, -1)], -1).float()
        if cfg.granularity != "token":
            rank, _ = candidate_ranks(torch.ones(1, cfg.n_tokens, dtype=torch.bool, device=device))
            feats = group_centroids(feats, group_ids(rank, group), units)
        params = dict(alpha=0.25, eta=0.25, lam=0.25, eps0=1e-6, novelty=cfg.novelty)
        t0 = time.perf_counter()
        ref = naive_cords(feats[0], cfg.heads * cfg.head_dim, steps, **params)
        sync(device)
        row["naive"] = (time.perf_counter() - t0) / total
        fast = sel.select(keys, values, cfg.budget, granularity=cfg.granularity, group_size=cfg.group_size)
        got = [int(u) for u in fast.order[0] if int(u) >= 0]
        row["agree"] = len(set(got) & set(ref)) / max(len(ref), 1)
    return row


def configs(quick: bool) -> list[Config]:
    out = []
    sizes = [1024, 4096, 16384] if quick else [1024, 4096, 16384, 65536]
    shapes = [(4, 128)] if quick else [(2, 64), (4, 128)]
    for heads, dim in shapes:
        for n in sizes:
            for novelty in ("max_cosine", "exact"):
                out.append(Config(n, heads, dim, n // 8, "token", None, novelty))
                out.append(Config(n, heads, dim, n // 8, "frame", 64, novelty))
                out.append(Config(n, heads, dim, n // 8, "block", 16, novelty))
                out.append(Config(n, heads, dim, n // 8, "block", 128, novelty))
                if not quick:
                    out.append(Config(n, heads, dim, n // 4, "block", 16, novelty))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and shapes")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-token-steps", type=int, default=256,
                    help="cap on timed greedy steps at token granularity (the rest is extrapolated)")
    ap.add_argument("--naive-budget", type=float, default=3.0, help="seconds allowed per naive reference run")
    ap.add_argument("--device", default=None, help="cpu, cuda (default: both when CUDA is present)")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device(args.device)] if args.device else [torch.device("cpu")] + (
        [torch.device("cuda")] if torch.cuda.is_available() else [])

    lines = ["# Selection speed (`benchmarks/selection_speed.py`)", ""]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    lines += [f"- CPU: {cpu_model()}, {os.cpu_count()} cores visible, torch {torch.__version__}, "
              f"{torch.get_num_threads()} intra-op threads; load average at start "
              f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"]
    if torch.cuda.is_available():
        lines += [f"- GPU: {torch.cuda.get_device_name()}"]
    lines += ["- inputs bf16 `[1, H, N, D]`, computed in fp32; budget b tokens; frame = 64 tokens;"
              " block = 16 or 128 tokens; one problem, joint heads (`per_head=False`)", ""]
    print("\n".join(lines), flush=True)
    for device in devices:
        bw = copy_bandwidth(device)
        head = [f"## {device.type}: measured copy bandwidth {bw / 1e9:.1f} GB/s", "",
                "| N | HxD | b | granularity | novelty | units | steps | ms | ms/step | GB/s | x floor "
                "| naive x |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        print("\n".join(head), flush=True)
        lines += head
        for cfg in configs(args.quick):
            r = run_config(cfg, device, args.repeats, args.max_token_steps, bw, args.naive_budget)
            gran = cfg.granularity + (f"/{cfg.group_size}" if cfg.group_size else "")
            naive = "-" if r["naive"] is None else f"{r['naive']:.0f} (agree {r['agree']:.2f})"
            ms = f"{r['ms']:.1f}" + ("*" if r["extrapolated"] else "")
            line = (f"| {cfg.n_tokens} | {cfg.heads}x{cfg.head_dim} | {cfg.budget} | {gran} | "
                    f"{cfg.novelty} | {r['units']} | {r['steps']} | {ms} | {r['ms_step']:.3f} | "
                    f"{r['gbs']:.1f} | {r['x_floor']:.2f} | {naive} |")
            print(line, flush=True)
            lines.append(line)
        lines.append("")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
