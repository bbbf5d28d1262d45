"""Cost of one compression: the Triton kernels against the PyTorch path and the copy floor, in one run.

Runs the pure compress step (:func:`~cords_vllm.compress.step.compress_region`, no vLLM) on a paged KV cache of a
7B model's shape (Qwen2-VL-7B: 28 layers, 4 KV heads x 128, bf16, block 16) holding one stream's region of
7,744 tokens (64 text tokens, 30 frames of 256) and keeping 6,208 (24 frames), at ``cords``'s defaults, per
granularity and anchor set, with each implementation (``--kernels``). Per row:

* ``wall ms``: one compression as the worker sees it (its batch gives the entering labels' runs, as the worker's
  does, so a frame compression reads nothing back), launches and any host read included (median of
  ``--repeats``; the caches are restored from a pristine copy between runs, outside the timing);
* ``GPU ms``: the time between CUDA events around it (the device waits for the host's launches too);
  ``busy ms``: what the device's kernels and copies took, added up (profiler);
* ``launches``: CUDA kernels and copies the device ran (profiler), ``syncs``: host synchronisations
  (``torch.cuda.set_sync_debug_mode``); a second table splits the kernel rows' busy time by kernel (profiler);
* ``x floor``: wall time over the copy floor, the region read and the kept tokens written once in every layer at
  the copy bandwidth measured in the same run; ``x torch``: the PyTorch path's wall time over this row's;
* ``same ids``: every layer keeps exactly the tokens the PyTorch path keeps;
* ``path``: what ran on the kernel path: the fused step (:mod:`cords_vllm.compress.step_triton`), or the greedy
  kernel and the copy around the PyTorch plumbing where the fused step does not cover the case.

Each kernel row first runs the start-up warm-up (:mod:`cords_vllm.compress.kernel_warmup`) for a server whose
compressions take this region (budget: the kept video tokens; slack: the rest of the region's video): a third table
gives its variants and seconds (on a fresh machine, the compiles a server's start-up adds, less what earlier rows
compiled already; later, Triton's disk cache) and how many kernel variants the row's own compressions compiled after
it, which must be none.

It ends with the issue's targets (frame <= 1 ms, block <= 2 ms, token <= 25 ms: 15 would need CTA clusters, which
Triton 3.6 cannot compile; anchors [0, 2, 4] <= 1.5x anchors [0], <= 1 sync and <= 16 launches per compression),
each PASS or MISS, and writes
``compress_step.json`` and ``compress_step.md`` to ``--out``.

Usage: ``python benchmarks/compress_step.py [--device cuda] [--out DIR]``; ``--quick``: a small shape (on CPU
under ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter: a smoke run, not a timing). Needs torch
and Triton only. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from cords_vllm.compress import step_kernels, step_triton
from cords_vllm.compress.frames import label_runs
from cords_vllm.compress.kernel_warmup import WarmupWidths, compiled_variants, warm_up
from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.step import RegionBatch, SelectionSetup, compress_region
from cords_vllm.compress.unit_choice import AUTO, compression_unit
from cords_vllm.kernel_backend import kernels_in_force, use_triton
from cords_vllm.lab.bench.region_shape import RegionShape
from cords_vllm.selection import cords_triton, get_selector

#: The issue's targets on an H100-class GPU: wall ms per compression at the default shape.
TARGET_MS = {"frame": 1.0, "block": 2.0, "token": 25.0}
TARGET_LAUNCHES = 16
TARGET_SYNCS = 1
TARGET_ANCHOR_RATIO = 1.5


@dataclass(frozen=True)
class Case:
    name: str
    granularity: str
    anchors: tuple[int, ...]
    shape: RegionShape
    params: tuple[tuple[str, object], ...] = ()  # cords's settings, beside its defaults


@dataclass
class Row:
    case: str
    kernels: str
    held: int
    kept: int
    wall_ms: float
    wall_min_ms: float
    gpu_ms: float | None
    busy_ms: float | None
    launches: int | None
    syncs: int | None
    floor_ms: float
    path: str = ""
    same_ids: bool | None = None
    x_torch: float | None = None
    busy_by_kernel: dict[str, float] | None = None  # device ms per kernel, largest first (CUDA only)
    warmup_s: float | None = None  # the kernel path's start-up warm-up for this region's server
    warmup_variants: int | None = None
    compiled_after_warmup: int | None = None  # kernel variants the row's compressions compiled (none expected)
    notes: list[str] = field(default_factory=list)


#: The ablation's novelty (``cords`` with ``novelty="exact"``): its rows are reported, not held to the targets.
EXACT = (("novelty", "exact"),)


def cases(quick: bool) -> list[Case]:
    """The issue's shape (or a small one), per granularity, one anchor and three, a small token region, and the
    exact novelty at frame units and on the small token region."""
    if quick:
        big = RegionShape(layers=6, heads=2, head_size=16, block_size=8, text=8, frame_tokens=16, frames=8,
                          keep_frames=5)
        small = replace(big, frames=4, keep_frames=3)
        three = (0, 2, 4)
    else:
        big = RegionShape()
        small = replace(big, frames=5, keep_frames=4)
        three = (0, 2, 4)
    return [Case("auto (the default), anchors [0]", AUTO, (0,), big),
            Case("frame, anchors [0]", "frame", (0,), big),
            Case(f"frame, anchors {list(three)}", "frame", three, big),
            Case("block, anchors [0]", "block", (0,), big),
            Case("token, anchors [0]", "token", (0,), big),
            Case(f"token, {small.held} -> {small.kept} tokens", "token", (0,), small),
            Case("frame (exact novelty), anchors [0]", "frame", (0,), big, EXACT),
            Case(f"token (exact novelty), {small.held} -> {small.kept} tokens", "token", (0,), small, EXACT)]


def anchor_of(anchors: tuple[int, ...], layers: int) -> tuple[int, ...]:
    return tuple(max(a for a in anchors if a <= layer) for layer in range(layers))


def build(shape: RegionShape, granularity: str, device: torch.device, dtype: torch.dtype
          ) -> tuple[list[torch.Tensor], RegionBatch]:
    """Caches of every layer (one allocation each, as vLLM makes them) and the region's first compression
    (``granularity`` ``"auto"``: the unit the worker would choose, :func:`compression_unit`)."""
    bs = shape.block_size
    unit = compression_unit(granularity, shape.kept - shape.text, shape.frame_tokens)
    region_blocks = shape.held // bs
    num_blocks = region_blocks + 16
    g = torch.Generator(device="cpu").manual_seed(0)
    caches = [torch.randn(num_blocks, shape.heads, bs, 2 * shape.head_size, generator=g).to(device, dtype)
              for _ in range(shape.layers)]
    blocks = torch.randperm(num_blocks, generator=g)[:region_blocks].to(device)
    host_labels = torch.cat([torch.zeros(shape.text, dtype=torch.long),
                             torch.arange(shape.frames).repeat_interleave(shape.frame_tokens) + 1])
    labels = host_labels.to(device)
    batch = RegionBatch(
        src_slots=slots_of(blocks, bs), dst_slots=slots_of(blocks[: shape.kept // bs], bs),
        new_ids=torch.arange(shape.held, device=device),
        spans=torch.tensor([[shape.text, shape.held]], device=device),
        new_labels=labels if granularity in ("frame", AUTO) else None,
        new_label_runs=label_runs(host_labels, torch.arange(shape.held) >= shape.text)
        if granularity in ("frame", AUTO) else None, num_keep=shape.kept,
        num_keep_candidates=shape.kept - shape.text, num_candidates=shape.held - shape.text,
        group_size={"frame": shape.frame_tokens, "block": unit.group_size or bs}.get(unit.granularity),
        frame_tokens=shape.frame_tokens, granularity=unit.granularity)
    return caches, batch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read + written), measured on 1 GiB (64 MiB on CPU)."""
    n = (1 << 30 if device.type == "cuda" else 1 << 26) // 4
    x, y = torch.empty(n, device=device), torch.empty(n, device=device)
    times = []
    for _ in range(5):
        synchronize(device)
        t0 = time.perf_counter()
        y.copy_(x)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * 4 * n / min(times)


def kernel_name(name: str) -> str:
    """A device event's name, short: a Triton kernel's function name as it is, a CUDA C++ kernel's unqualified name
    without its template arguments or signature (``void at::native::f<...>(...)`` -> ``f``)."""
    name = name.removeprefix("void ").split("<", 1)[0].split("(", 1)[0].strip()
    return name.rsplit("::", 1)[-1] or name


def busy_by_kernel(events: list[tuple[str, float]], top: int = 6) -> dict[str, float]:
    """Device milliseconds per kernel name (:func:`kernel_name`), largest first, from ``(name, microseconds)``
    events: the ``top`` largest, the rest added up as ``"other"``."""
    totals: dict[str, float] = {}
    for name, us in events:
        key = kernel_name(name)
        totals[key] = totals.get(key, 0.0) + us / 1e3
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    out = dict(ranked[:top])
    if len(ranked) > top:
        out["other"] = sum(ms for _, ms in ranked[top:])
    return out


def count_launches_and_syncs(run, device: torch.device
                             ) -> tuple[int | None, int | None, float | None, dict[str, float] | None]:
    """Kernels and copies the device ran, host synchronisations, the device's busy time (ms) of one ``run``, and that
    time by kernel (:func:`busy_by_kernel`)."""
    if device.type != "cuda":
        return None, None, None, None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        synchronize(device)
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = len(device_events)
    busy_ms = sum(e.time_range.elapsed_us() for e in device_events) / 1e3
    by_kernel = busy_by_kernel([(e.name, e.time_range.elapsed_us()) for e in device_events])
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return launches, syncs, busy_ms, by_kernel


def server_widths(case: Case) -> WarmupWidths:
    """The widths of a server whose compressions take ``case``'s region: its kept video tokens the budget, the rest
    of the region's video the slack, requests as long as the region."""
    shape = case.shape
    budget = shape.kept - shape.text
    return WarmupWidths.for_server(budget=budget, slack=shape.held - shape.text - budget,
                                   block_size=shape.block_size, max_rows=shape.held, granularity=case.granularity,
                                   frames_known=True)


def measure(case: Case, kernels: str, device: torch.device, dtype: torch.dtype, repeats: int, bandwidth: float,
            warm: bool = True) -> tuple[Row, list[torch.Tensor]]:
    """One row: ``case`` with ``kernels``; with ``warm``, the kernel path's start-up warm-up first."""
    shape = case.shape
    caches, batch = build(shape, case.granularity, device, dtype)
    setup = SelectionSetup(get_selector("cords", **dict(case.params)), case.granularity, False,
                           anchor_of(case.anchors, shape.layers), kernels=kernels)
    accessors = [PagedAccessor.of(caches[0], shape.head_size)] * shape.layers
    with kernels_in_force(kernels):
        warm = warm and use_triton(device)
    report = warm_up(caches, accessors, None, setup, server_widths(case)) if warm else None
    compiled = compiled_variants() if warm else None
    pristine = [c.clone() for c in caches]
    nonfinite = torch.zeros((), dtype=torch.long, device=device)  # the worker's count, which it always keeps

    def restore() -> None:
        for c, p in zip(caches, pristine, strict=True):
            c.copy_(p)

    def run() -> list:
        return compress_region(caches, accessors, [None] * shape.layers, batch, setup, nonfinite=nonfinite)

    held = run()  # warm-up (compiles the kernels); its kept ids are the row's
    ids = [h.ids.cpu() for h in held]
    walls, gpus = [], []
    for _ in range(repeats):
        restore()
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            end.record()
        synchronize(device)
        walls.append(1e3 * (time.perf_counter() - t0))
        if device.type == "cuda":
            gpus.append(start.elapsed_time(end))
    restore()
    def restore_then_run() -> None:
        restore()
        synchronize(device)
        run()

    launches, syncs, busy_ms, by_kernel = count_launches_and_syncs(restore_then_run, device)
    if launches is not None:  # the restore's copies are not the compression's
        _, _, restore_ms, restore_by_kernel = count_launches_and_syncs(restore, device)
        launches, busy_ms = launches - shape.layers, busy_ms - (restore_ms or 0.0)
        for name, ms in (restore_by_kernel or {}).items():
            if name in by_kernel:
                by_kernel[name] = max(0.0, by_kernel[name] - ms)
    element = caches[0].element_size()
    floor_bytes = shape.layers * (shape.held + shape.kept) * shape.heads * 2 * shape.head_size * element
    with kernels_in_force(kernels):
        fused = use_triton(device) and step_triton.covers(setup.selector, accessors, caches, None, setup.anchor_of)
    path = "fused step" if fused else "greedy kernel + copy" if kernels == "triton" else "PyTorch"
    row = Row(case=case.name, kernels=kernels, held=shape.held, kept=shape.kept, path=path,
              wall_ms=statistics.median(walls), wall_min_ms=min(walls),
              gpu_ms=statistics.median(gpus) if gpus else None, busy_ms=busy_ms, launches=launches, syncs=syncs,
              floor_ms=1e3 * floor_bytes / bandwidth, busy_by_kernel=by_kernel)
    if report is not None:
        row.warmup_s, row.warmup_variants = report.seconds, len(report.variants)
        after = compiled_variants()
        row.compiled_after_warmup = None if compiled is None or after is None else after - compiled
    return row, ids


#: The kernels ``--sweep-warps`` tunes, each by the module function whose choice it forces: the plan and finish
#: programs (which hold a region's rows) and the greedy run (which holds a problem's units).
SWEEPS = {"plan + finish": (step_kernels, "_row_warps"), "greedy": (cords_triton, "_warps")}
#: The warps each kernel is timed at.
SWEEP_WARPS = (1, 2, 4, 8, 16, 32)
#: Warps too few for a kernel's widest rows (thousands of rows on one or two warps spill): timed only where the greedy
#: run holds a few hundred units or fewer (frame and block units), whose steps wait on three program-wide
#: reductions each, which one or two warps make without a barrier.
FEW_WARPS = (1, 2)
#: The cases ``--sweep-warps`` times: one anchor at each unit.
SWEEP_CASES = ("frame, anchors [0]", "block, anchors [0]", "token, anchors [0]")


def swept(case: Case) -> list[tuple[str, int]]:
    """The ``(kernel, warps)`` settings ``--sweep-warps`` times for ``case``: each of :data:`SWEEPS` at each of
    :data:`SWEEP_WARPS`, but :data:`FEW_WARPS` only for the greedy run at frame and block units."""
    return [(kernel, warps) for kernel in SWEEPS for warps in SWEEP_WARPS
            if warps not in FEW_WARPS or (kernel == "greedy" and case.granularity != "token")]


def sweep_warps(chosen: list[Case], device: torch.device, dtype: torch.dtype, repeats: int, bandwidth: float,
                reference: dict[str, list[torch.Tensor]]) -> list[dict]:
    """The fused step's wall time with each kernel's warps forced to each of :data:`SWEEP_WARPS` in turn (the
    others as chosen; :data:`FEW_WARPS` for the greedy run at frame and block units only), per case; whether the
    setting kept the same ids (it must: the kernels' reductions are maxima, minima and integer sums, exact in any
    order); and which setting the module's rule picks today."""
    out = []
    for case in chosen:
        for kernel, warps in swept(case):
            module, name = SWEEPS[kernel]
            rule = getattr(module, name)
            picked = []  # what the rule would have picked, seen as the kernel launches

            def forced(block: int, w: int = warps, rule=rule, picked=picked) -> int:
                picked.append(rule(block))
                return w
            setattr(module, name, forced)
            try:
                row, ids = measure(case, "triton", device, dtype, repeats, bandwidth, warm=False)
            finally:
                setattr(module, name, rule)
            today = warps in picked[:1]
            same = None if case.name not in reference else all(
                torch.equal(a, b) for a, b in zip(reference[case.name], ids, strict=True))
            out.append({"case": case.name, "kernel": kernel, "warps": warps, "wall_ms": row.wall_ms,
                        "busy_ms": row.busy_ms, "today": today, "same_ids": same})
            print(f"{case.name:32s} {kernel:14s} warps {warps:2d}  wall {row.wall_ms:9.2f} ms  "
                  f"same ids {same}", flush=True)
    return out


def sweep_markdown(sweep: list[dict]) -> str:
    """One row per case and kernel: the wall ms at each setting, today's rule's in bold."""
    lines = ["| case | kernel | " + " | ".join(f"{w} warps" for w in SWEEP_WARPS) + " | same ids |",
             "|---|---|" + "---|" * (len(SWEEP_WARPS) + 1)]
    keys = dict.fromkeys((r["case"], r["kernel"]) for r in sweep)
    for case, kernel in keys:
        cells = {r["warps"]: r for r in sweep if (r["case"], r["kernel"]) == (case, kernel)}
        text = [("**{:.2f}**" if cells[w]["today"] else "{:.2f}").format(cells[w]["wall_ms"]) if w in cells else "-"
                for w in SWEEP_WARPS]
        same = [r["same_ids"] for r in cells.values() if r["same_ids"] is not None]
        lines.append(f"| {case} | {kernel} | " + " | ".join(text) + f" | {'-' if not same else all(same)} |")
    return "\n".join(lines) + "\n"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, torch {torch.__version__}"
    return f"{platform.processor() or 'CPU'}, torch {torch.__version__}"


def targets(rows: list[Row]) -> list[tuple[str, bool | None, str]]:
    """(target, met or None when not measured, what was measured) for the kernel rows."""
    out = []
    kernel = {r.case: r for r in rows if r.kernels == "triton"}
    for name, row in kernel.items():
        gran = name.split(",")[0]
        if "anchors [0]" in name and gran in TARGET_MS:
            out.append((f"{gran} <= {TARGET_MS[gran]:g} ms", row.wall_ms <= TARGET_MS[gran], f"{row.wall_ms:.2f} ms"))
    one, three = kernel.get("frame, anchors [0]"), next((r for n, r in kernel.items() if n.startswith(
        "frame, anchors [0, ")), None)
    if one and three:
        ratio = three.wall_ms / one.wall_ms
        out.append((f"anchors [0, 2, 4] <= {TARGET_ANCHOR_RATIO:g}x anchors [0]", ratio <= TARGET_ANCHOR_RATIO,
                    f"{ratio:.2f}x"))
    measured = [r for r in kernel.values() if r.syncs is not None]
    if measured:
        worst = max(r.syncs for r in measured)
        out.append((f"<= {TARGET_SYNCS} host sync per compression", worst <= TARGET_SYNCS, f"at most {worst}"))
        most = max(r.launches for r in measured)
        out.append((f"<= {TARGET_LAUNCHES} launches per compression", most <= TARGET_LAUNCHES, f"at most {most}"))
    same = [r.same_ids for r in kernel.values() if r.same_ids is not None]
    if same:
        out.append(("same kept ids as the PyTorch path", all(same), f"{sum(same)} of {len(same)} cases"))
    after = [r.compiled_after_warmup for r in kernel.values() if r.compiled_after_warmup is not None]
    if after:
        out.append(("nothing compiles after the start-up warm-up", sum(after) == 0,
                    f"{sum(after)} variants in {len(after)} cases"))
    return out


def markdown(rows: list[Row], checks: list[tuple[str, bool | None, str]], header: dict) -> str:
    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = [f"Device: {header['device']}; copy bandwidth {header['copy_gb_s']:.0f} GB/s (measured).", "",
             "| case | kernels | path | wall ms | GPU ms | busy ms | launches | syncs | x floor | x torch | same ids |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.case} | {r.kernels} | {r.path} | {r.wall_ms:.2f} | {fmt(r.gpu_ms)} | {fmt(r.busy_ms)} | "
                     f"{fmt(r.launches, 'd')} | "
                     f"{fmt(r.syncs, 'd')} | {r.wall_ms / r.floor_ms:.0f} | {fmt(r.x_torch, '.1f')} | "
                     f"{'-' if r.same_ids is None else ('yes' if r.same_ids else 'NO')} |")
    split = [r for r in rows if r.kernels == "triton" and r.busy_by_kernel]
    if split:  # where the kernel rows' device time goes: what to fuse or tune next
        lines += ["", "| case (triton) | device ms by kernel, largest first |", "|---|---|"]
        lines += [f"| {r.case} | " + ", ".join(f"{name} {ms:.3f}" for name, ms in r.busy_by_kernel.items()) + " |"
                  for r in split]
    warmed = [r for r in rows if r.warmup_variants is not None]
    if warmed:  # what a server's start-up compiles for such regions, and whether serving then compiled anything
        lines += ["", "| case (triton) | warm-up variants | warm-up s | compiled after it |", "|---|---|---|---|"]
        lines += [f"| {r.case} | {r.warmup_variants} | {r.warmup_s:.1f} | {fmt(r.compiled_after_warmup, 'd')} |"
                  for r in warmed]
    if checks:
        lines += ["", "| target | result | measured |", "|---|---|---|"]
        lines += [f"| {t} | {'PASS' if ok else 'MISS'} | {m} |" for t, ok, m in checks]
    return "\n".join(lines) + "\n"


def save(out: Path, header: dict, rows: list[Row], device: torch.device, sweep: list[dict]) -> str:
    """Write ``compress_step.json`` and ``compress_step.md`` to ``out`` (the targets on CUDA); returns the table."""
    checks = targets(rows) if device.type == "cuda" else []
    out.mkdir(parents=True, exist_ok=True)
    (out / "compress_step.json").write_text(json.dumps(
        {"header": header, "rows": [asdict(r) for r in rows],
         "targets": [{"target": t, "met": ok, "measured": m} for t, ok, m in checks], "warps": sweep},
        indent=2) + "\n")
    table = markdown(rows, checks, header)
    if sweep:
        table += "\nWall ms of the fused step by warps (today's rule in bold):\n\n" + sweep_markdown(sweep)
    (out / "compress_step.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    p.add_argument("--repeats", type=int, default=None, help="timed runs per row (default 10; 2 for torch token)")
    p.add_argument("--quick", action="store_true", help="a small shape (a smoke run)")
    p.add_argument("--only", default=None, help="run the cases whose name contains this text")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/compress_step"))
    p.add_argument("--sweep-warps", action="store_true",
                   help="then time the fused step at each warps setting of its row and greedy kernels (frame, block "
                        "and token at one anchor): the data to tune them on a GPU")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth(device)
    header = {"device": device_name(device), "copy_gb_s": bandwidth / 1e9, "dtype": str(dtype),
              "python": sys.version.split()[0]}
    print(f"# compress step on {header['device']}; copy {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows: list[Row] = []
    kept: dict[str, list[torch.Tensor]] = {}  # the PyTorch path's kept ids per case
    for case in cases(args.quick):
        if args.only and args.only not in case.name:
            continue
        reference = None
        for kernels in sorted(args.kernels, key=lambda k: k != "torch"):  # the reference first
            slow = kernels == "torch" and case.granularity == "token" and not args.quick
            repeats = args.repeats or (2 if slow else 10)
            row, ids = measure(case, kernels, device, dtype, repeats, bandwidth)
            if kernels == "torch":
                reference = (row, ids)
                kept[case.name] = ids
            elif reference is not None:
                row.same_ids = all(torch.equal(a, b) for a, b in zip(reference[1], ids, strict=True))
                row.x_torch = reference[0].wall_ms / row.wall_ms
            rows.append(row)
            split = ", ".join(f"{name} {ms:.2f}" for name, ms in (row.busy_by_kernel or {}).items())
            print(f"{case.name:32s} {kernels:6s} wall {row.wall_ms:9.2f} ms  GPU {row.gpu_ms or 0:8.2f} ms  "
                  f"launches {row.launches}  syncs {row.syncs}  same ids {row.same_ids}"
                  + (f"  busy ms: {split}" if split else ""), flush=True)
            save(args.out, header, rows, device, [])  # so far: a run cut short keeps its rows
    sweep = []
    if args.sweep_warps:
        chosen = [c for c in cases(args.quick) if c.name in SWEEP_CASES and (not args.only or args.only in c.name)]
        sweep = sweep_warps(chosen, device, dtype, args.repeats or 10, bandwidth, kept)
    print(save(args.out, header, rows, device, sweep))
    same = [r.same_ids for r in rows] + [r["same_ids"] for r in sweep]
    return 0 if all(x is not False for x in same) else 1


if __name__ == "__main__":
    sys.exit(main())
