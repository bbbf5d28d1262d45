"""What one selection costs per unit: ``token``, ``frame`` and ``auto`` granularity, in one run, same inputs.

    python benchmarks/unit_cost.py                 # the two throughput workloads' shapes
    python benchmarks/unit_cost.py --heads 4 --head-size 128 --shape 7744:6144:256

Times the selector alone (``cords`` at its defaults, joint selection over ``--heads`` KV heads of ``--head-size``;
no copy, no engine) on random keys and values, for each ``candidates:kept:frame_tokens`` shape, and prints each
unit's milliseconds and its ratio to ``frame``. ``auto`` is resolved as the worker resolves it
(:func:`cords_vllm.compress.unit_choice.compression_unit`). Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from cords_vllm.compress.unit_choice import DEFAULT_MIN_UNITS, Unit, compression_unit
from cords_vllm.selection import get_selector


def select_ms(unit: Unit, keys: torch.Tensor, values: torch.Tensor, kept: int, frame_tokens: int,
              repeats: int) -> float:
    """Median wall milliseconds of one selection of ``kept`` of the ``[1, H, N, D]`` candidates at ``unit``."""
    n = keys.shape[2]
    kwargs: dict = {}
    if unit.granularity == "frame":
        kwargs = {"group_size": frame_tokens, "group_index": (torch.arange(n) // frame_tokens)[None]}
    elif unit.granularity == "block":
        kwargs = {"group_size": unit.group_size}
    selector, candidates = get_selector("cords"), torch.ones(1, n, dtype=torch.bool)
    selector.select(keys, values, kept, candidates=candidates, granularity=unit.granularity, **kwargs)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        selector.select(keys, values, kept, candidates=candidates, granularity=unit.granularity, **kwargs)
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", default=["2048:384:64", "16384:1536:256"],
                   help="candidates:kept:frame_tokens (defaults: the short and long throughput workloads)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--min-units", type=int, default=DEFAULT_MIN_UNITS)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell (token: 1)")
    args = p.parse_args(argv)
    print(f"cords, joint selection over {args.heads} KV heads of {args.head_size}, {torch.get_num_threads()} threads")
    print("| candidates | kept | frame | unit | ms | x frame |\n|---|---|---|---|---|---|")
    for text in args.shape:
        n, kept, frame = (int(x) for x in text.split(":"))
        g = torch.Generator().manual_seed(0)
        keys = torch.randn(1, args.heads, n, args.head_size, generator=g)
        values = torch.randn(1, args.heads, n, args.head_size, generator=g)
        auto = compression_unit("auto", kept, frame, args.min_units)
        runs = "" if auto.group_size is None else f", runs of {auto.group_size}"
        units = {"frame": Unit("frame"), f"auto ({auto.granularity}{runs})": auto, "token": Unit("token")}
        ms = {name: select_ms(unit, keys, values, kept, frame, 1 if unit.granularity == "token" else args.repeats)
              for name, unit in units.items()}
        for name, value in ms.items():
            print(f"| {n} | {kept} | {frame} | {name} | {value:.1f} | {value / ms['frame']:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
