"""Cost of an engine step's compressions: carried out together against one after another, in one run.

Runs the pure compress step (no vLLM) on one paged KV cache holding ``N`` requests' regions (each its own blocks,
regions of different lengths, ``cords`` defaults at ``granularity: auto``, the unit the worker would choose), for
each ``N`` of ``--requests``:

* ``alone ms``: the ``N`` compressions one after another (:func:`~cords_vllm.compress.step.compress_region` per
  request: what the worker did before);
* ``together ms``: the same compressions in one :func:`~cords_vllm.compress.step.compress_regions` call (what the
  worker does: the greedy orders of every request in one policy call; on the fused kernel path one greedy run);
* ``speed-up``: alone over together; ``same``: every request keeps the same tokens and the caches end equal, bit
  for bit.

Medians of ``--repeats`` (the caches are restored from a pristine copy between runs, outside the timing), per
implementation (``--kernels``: the PyTorch path, what a CPU runs, and on CUDA the Triton kernels, where a step's
fused compressions share one greedy run). Prints a table and writes ``step_together.json`` to ``--out``. Not a test:
numbers depend on the machine.

Usage: ``python benchmarks/step_together.py [--requests 1 2 4 8] [--granularity auto] [--device cuda] [--quick]``
(``scripts/gpu-core-check.sh`` runs it on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.step import RegionBatch, RegionCompression, SelectionSetup, compress_region, compress_regions
from cords_vllm.compress.unit_choice import AUTO, compression_unit
from cords_vllm.lab.bench.region_shape import RegionShape
from cords_vllm.selection import get_selector
from cords_vllm.threads import intra_op_threads

#: A 7B model's cache (:class:`RegionShape`'s) and short regions: twelve 64-token frames, eight kept.
SHAPE = RegionShape(frame_tokens=64, frames=12, keep_frames=8)


@dataclass
class Row:
    kernels: str
    requests: int
    alone_ms: float
    together_ms: float
    speedup: float
    same: bool


def build(shape: RegionShape, requests: int, granularity: str = AUTO, device: str = "cpu", seed: int = 0
          ) -> tuple[list[torch.Tensor], list[RegionBatch]]:
    """Caches and one first compression per request; request ``r`` holds ``r % 3`` frames more than the first."""
    g = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    regions = [(shape.text + (shape.frames + r % 3) * shape.frame_tokens) // bs for r in range(requests)]
    num_blocks = 1 + sum(regions)
    caches = [torch.randn(num_blocks, shape.heads, bs, 2 * shape.head_size, generator=g).to(device)
              for _ in range(shape.layers)]
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # every request's blocks scattered over the pool
    batches, first = [], 0
    for region in regions:
        blocks = order[first:first + region]
        first += region
        frames = (region * bs - shape.text) // shape.frame_tokens + 1
        labels = torch.cat([torch.zeros(shape.text, dtype=torch.long),
                            torch.arange(frames).repeat_interleave(shape.frame_tokens) + 1])[: region * bs]
        kept = (shape.text + shape.keep_frames * shape.frame_tokens) // bs * bs
        unit = compression_unit(granularity, kept - shape.text, shape.frame_tokens)
        blocks = blocks.to(device)
        batches.append(RegionBatch(
            src_slots=slots_of(blocks, bs), dst_slots=slots_of(blocks[: kept // bs], bs),
            new_ids=torch.arange(region * bs, device=device), spans=torch.tensor([[shape.text, region * bs]],
                                                                                 device=device),
            new_labels=labels.to(device),
            num_keep=kept, num_keep_candidates=kept - shape.text, num_candidates=region * bs - shape.text,
            group_size={"frame": shape.frame_tokens, "block": unit.group_size or bs}.get(unit.granularity),
            frame_tokens=shape.frame_tokens, granularity=unit.granularity))
    return caches, batches


def measure(shape: RegionShape, requests: int, repeats: int, kernels: str = "torch", granularity: str = AUTO,
            device: str = "cpu") -> Row:
    caches, batches = build(shape, requests, granularity, device)
    pristine = [c.clone() for c in caches]
    accessors = [PagedAccessor.of(caches[0], shape.head_size)] * shape.layers
    setup = SelectionSetup(get_selector("cords"), granularity, False, (0,) * shape.layers, kernels=kernels)
    sync = torch.cuda.synchronize if caches[0].device.type == "cuda" else (lambda: None)
    nonfinite = torch.zeros((), dtype=torch.long, device=caches[0].device)  # the worker's count, which it always keeps

    def restore() -> None:
        for c, p in zip(caches, pristine, strict=True):
            c.copy_(p)

    def alone() -> list:
        return [compress_region(caches, accessors, [None] * shape.layers, b, setup, nonfinite=nonfinite)
                for b in batches]

    def together() -> list:
        return compress_regions(caches, accessors, [RegionCompression([None] * shape.layers, b) for b in batches],
                                setup, nonfinite=nonfinite)

    results, times = {}, {"alone": [], "together": []}
    for name, run in (("alone", alone), ("together", together)):  # a warm-up run of each, kept for the check
        restore()
        results[name] = (run(), [c.clone() for c in caches])
    for _ in range(repeats):  # interleaved, so drift hits both alike
        for name, run in (("alone", alone), ("together", together)):
            restore()
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            times[name].append(1e3 * (time.perf_counter() - t0))
    restore()
    (held_a, caches_a), (held_t, caches_t) = results["alone"], results["together"]
    same = all(isinstance(t, list) and all(torch.equal(x.ids, y.ids) for x, y in zip(a, t, strict=True))
               for a, t in zip(held_a, held_t, strict=True))
    same &= all(torch.equal(a, t) for a, t in zip(caches_a, caches_t, strict=True))
    alone_ms, together_ms = statistics.median(times["alone"]), statistics.median(times["together"])
    return Row(kernels, requests, alone_ms, together_ms, alone_ms / together_ms, same)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8], help="compressions per step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (the worker's default: 1)")
    p.add_argument("--granularity", default=AUTO, choices=[AUTO, "frame", "block", "token"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", nargs="+", default=None, choices=["torch", "triton"],
                   help="default: triton and torch on CUDA, torch elsewhere")
    p.add_argument("--quick", action="store_true", help="a small shape (a smoke run)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/step_together"))
    args = p.parse_args(argv)
    shape = RegionShape(layers=4, heads=2, head_size=16, block_size=8, text=8, frame_tokens=16, frames=6,
                        keep_frames=3) if args.quick else SHAPE
    kernels = args.kernels or (["triton", "torch"] if args.device.startswith("cuda") else ["torch"])
    rows = []
    with intra_op_threads(args.threads), torch.inference_mode():
        for k in kernels:
            for n in args.requests:
                rows.append(measure(shape, n, args.repeats, k, args.granularity, args.device))
                r = rows[-1]
                print(f"{k}, {n} requests: alone {r.alone_ms:.1f} ms, together {r.together_ms:.1f} ms "
                      f"({r.speedup:.2f}x), same {r.same}", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, " \
        f"{args.threads} intra-op thread(s)"
    machine = f"{device}, torch {torch.__version__}"
    lines = [f"A step's compressions, together vs one after another ({machine}; granularity {args.granularity}; "
             f"{shape})", "",
             "| kernels | requests | alone ms | together ms | speed-up | same tokens and caches |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.kernels} | {r.requests} | {r.alone_ms:.1f} | {r.together_ms:.1f} | {r.speedup:.2f}x | {r.same} |"
              for r in rows]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_together.json").write_text(json.dumps(
        {"machine": machine, "granularity": args.granularity, "shape": asdict(shape),
         "rows": [asdict(r) for r in rows]}, indent=2))
    return 0 if all(r.same for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
