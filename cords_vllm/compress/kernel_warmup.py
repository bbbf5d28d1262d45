"""The compress step's Triton kernels compiled at start-up, at every width the server's compressions can take.

Triton compiles a kernel at its first launch with each set of compile-time settings. The kernels leave every size
unspecialized (the ``NOT_SPECIALIZED`` tables) and pad their units to a multiple of 16, so what still compiles per
size is a *width*: the plan and finish programs' rows (``BLOCK_T``, the power of two above a region's tokens, with
its warps) and the greedy kernel's units (``BLOCK``). On a GPU each new width would otherwise stop a serving step
for the compile, seconds each (the kernels compiled for sm_90 take 1 to 7 s each on two CPU cores), the first time
a compression reaches it on each machine: long after start-up, in the middle of a batch. vLLM warms its own
kernels at start-up (dummy runs, graph capture) for the same reason.

The widths a server can need follow from its limits (:meth:`WarmupWidths.for_server`, from the planner's rules):

* a compression happens once a request holds more than ``budget + slack`` video tokens (the newest, partial block
  left out), so a region holds more than ``budget + slack - block_size`` rows, and at most ``max_model_len``; a
  request may narrow its budget down to one token and its recent window below that (the stream API's overrides),
  so the fewest rows follow from the slack alone;
* its candidates are those rows' video tokens but the recent window's, at most the server's ``budget + slack`` and
  two blocks (the footprint the start-up rule admits by), at least what a region's fewest rows leave past a
  narrowed request's recent window: at token granularity the greedy run's units; in frames or runs of tokens there
  are fewer units, any count from one up;
* the unit modes the plan and units programs take follow the granularity (``auto``: all three), and the rows carry
  frame labels where the granularity reads frames and the model has them.

:func:`warm_up` runs two small compressions (a first and a later one) on blocks of the engine's own cache, free at
start-up, with their launches recorded (:func:`~cords_vllm.kernel_backend.recording`), then compiles each recorded
launch again (Triton's ``warmup``: compiled and cached, not launched) at every width and unit mode in those limits.
Nothing else of a launch changes with a compression's size, so each variant compiled is the one a real compression
of that width launches (``tests/compress/test_kernel_warmup.py`` checks it with Triton's own specialization of
real compressions). Triton's disk cache keeps the compiled kernels: a later start loads them in milliseconds.
No vLLM import.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from cords_vllm.compress import copy_triton, step_kernels, step_triton
from cords_vllm.compress.kv_access import KVAccessor, PagedAccessor, slots_of
from cords_vllm.compress.kv_codec import KVCodec
from cords_vllm.compress.step import RegionBatch, SelectionSetup, compress_region
from cords_vllm.compress.unit_choice import AUTO
from cords_vllm.kernel_backend import Launch, recording
from cords_vllm.selection import cords_triton
from cords_vllm.utils import cdiv

#: Blocks a template compression uses (block 0, vLLM's null block, is never written): a block of text, then frames.
TEMPLATE_BLOCKS = 5
_MODES = {"token": (step_triton.TOKEN,), "block": (step_triton.BLOCK, step_triton.TOKEN),
          "frame": (step_triton.FRAME,), AUTO: (step_triton.TOKEN, step_triton.BLOCK, step_triton.FRAME)}


def _powers(low: int, high: int) -> tuple[int, ...]:
    """The kernels' widths (powers of two, at least 16) of every count in ``[low, high]``."""
    low = max(low, 1)
    if high < low:
        return ()
    out = [max(16, 1 << (low - 1).bit_length())]
    while out[-1] < high:
        out.append(2 * out[-1])
    return tuple(out)


@dataclass(frozen=True)
class WarmupWidths:
    """What the kernels compile for: ``rows``, the plan and finish programs' widths; ``units``, the greedy kernel's;
    ``modes``, the unit modes of the plan and units programs (:data:`~cords_vllm.compress.step_triton.TOKEN`,
    ``BLOCK``, ``FRAME``); ``labels``, whether the rows carry frame labels."""

    rows: tuple[int, ...]
    units: tuple[int, ...]
    modes: tuple[int, ...]
    labels: bool

    @classmethod
    def for_server(cls, *, budget: int, slack: int, block_size: int, max_rows: int, granularity: str,
                   frames_known: bool) -> WarmupWidths:
        """The widths compressions can take on a server whose requests hold at most ``max_rows`` tokens (its
        max-model-len, or a request's bounded footprint where smaller), under a policy of ``budget`` and ``slack``
        tokens in blocks of ``block_size`` and ``granularity`` (``frames_known``: the model's frames are read from
        its positions), whatever budget and recent window a request narrows them to."""
        # held video > budget + slack with budget >= 1, less the partial block; and past a recent window < budget
        fewest = slack - block_size + 2
        rows = _powers(fewest, min(max_rows, step_triton.MAX_ROWS))
        # no request holds more candidates (the footprint the start-up rule admits by)
        most_units = min(max_rows, budget + slack + 2 * block_size, cords_triton.MAX_UNITS)
        if granularity == "token":
            units = _powers(fewest, most_units)
        elif granularity == "block":
            units = _powers(fewest // block_size, cdiv(most_units, block_size))
            units = tuple(sorted({*units, *_powers(fewest, most_units)}))  # the token fall-back
        else:  # frames, or auto's runs of any length: from one unit up
            units = _powers(1, most_units)
        labels = granularity in ("frame", AUTO) and frames_known
        modes = _MODES[granularity] if labels or granularity != AUTO else _MODES["block"]
        return cls(rows if units else (), units if rows else (), modes, labels)


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warm_up` compiled: the ``variants`` (each a launch at one width and mode), in ``seconds``."""

    widths: WarmupWidths
    variants: tuple[Launch, ...]
    seconds: float

    def describe(self) -> str:
        """The start-up log's line (the widths where it compiled for any: the copy alone has none)."""
        if not self.variants:
            return "nothing to compile"
        kernels = ", ".join(sorted({v.name for v in self.variants}))
        rows, units = self.widths.rows, self.widths.units
        where = f" for regions of {rows[0]}-{rows[-1]} rows and {units[0]}-{units[-1]} units" if rows and units else ""
        return f"compiled {len(self.variants)} kernel variants ({kernels}){where} in {self.seconds:.1f} s"


def variants(recorded: Sequence[Launch], widths: WarmupWidths) -> list[Launch]:
    """Every recorded launch at every width and mode of ``widths`` (once per distinct launch): the plan program at
    each mode and rows width, the units program at each mode, the finish program at each rows width, the greedy
    kernel at each units width; the others (the copy, the normalization) as they were launched."""
    out: dict[tuple, Launch] = {}
    for launch in recorded:
        for kwargs in _widened(launch, widths):
            key = (launch.name, launch.kernel, tuple(sorted(kwargs.items())), _kinds(launch.args))
            out.setdefault(key, replace(launch, kwargs=kwargs))
    return list(out.values())


def _widened(launch: Launch, widths: WarmupWidths) -> Iterator[dict]:
    kw = launch.kwargs
    if launch.name == "plan":
        for mode in widths.modes:
            for rows in widths.rows:
                yield {**kw, "MODE": mode, "LABELS": widths.labels, **step_triton.row_width(rows)}
    elif launch.name == "units":
        for mode in widths.modes:
            yield {**kw, "MODE": mode}
    elif launch.name == "finish":
        for rows in widths.rows:
            yield {**kw, **step_triton.row_width(rows)}
    elif launch.name == "greedy":
        for units in widths.units:
            yield {**kw, **cords_triton.unit_width(units)}
    else:
        yield dict(kw)


def _kinds(args: tuple) -> tuple:
    """What of a launch's arguments could tell two recorded launches apart in the compiled code: tensors' dtypes
    and integers' and floats' types (their values' classes are the kernels' own, fixed or unspecialized)."""
    return tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args)


def _finite(shape: torch.Size, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Finite values of ``dtype``: normal ones, or, for a cache of fp8 bytes, bytes of small positive numbers in
    both fp8 formats."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0x10, 0x60, shape, generator=g).to(dtype)


def template_batches(block_size: int, device: torch.device, labels: bool) -> tuple[RegionBatch, RegionBatch]:
    """A first and a later compression of one small request in blocks ``1 .. TEMPLATE_BLOCKS`` at token granularity:
    a block of text, four frames of a block each (labelled when ``labels``); the first keeps three blocks, the later
    one, of those, two."""
    bs, text, frames = block_size, block_size, TEMPLATE_BLOCKS - 1
    blocks = torch.arange(1, 1 + TEMPLATE_BLOCKS, device=device)
    ids = torch.arange(TEMPLATE_BLOCKS * bs, device=device)
    frame_labels = torch.cat([torch.zeros(text, dtype=torch.long), torch.arange(1, 1 + frames).repeat_interleave(bs)])
    first = RegionBatch(
        src_slots=slots_of(blocks, bs), dst_slots=slots_of(blocks[:3], bs), new_ids=ids,
        spans=torch.tensor([[text, TEMPLATE_BLOCKS * bs]], device=device),
        new_labels=frame_labels.to(device) if labels else None, num_keep=3 * bs, num_keep_candidates=3 * bs - text,
        num_candidates=TEMPLATE_BLOCKS * bs - text, frame_tokens=bs, granularity="token")
    later = replace(first, src_slots=slots_of(blocks[:3], bs), dst_slots=slots_of(blocks[:2], bs), new_ids=ids[:0],
                    new_labels=first.new_labels[:0] if labels else None, num_keep=2 * bs,
                    num_keep_candidates=2 * bs - text, num_candidates=3 * bs - text)
    return first, later


def warm_up(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor], codecs: Sequence[KVCodec] | None,
            setup: SelectionSetup, widths: WarmupWidths) -> WarmupReport:
    """Compile the kernels a server's compressions launch at every width of ``widths`` (see the module docstring).

    Writes blocks ``1 .. TEMPLATE_BLOCKS`` of every layer (finite values, for the template compressions) and puts
    back what they held. Run it on the caches' device with the setup's kernels in force, before the engine serves:
    the template compressions launch kernels (collectives too, under tensor parallelism: every rank runs it)."""
    start = time.perf_counter()
    slots = slots_of(torch.arange(1, 1 + TEMPLATE_BLOCKS, device=caches[0].device), accessors[0].block_size)
    layers = [(a, c) for a, c in zip(accessors, caches, strict=True) if c.numel()]  # an empty cache holds nothing
    saved = [a.read(c, slots) for a, c in layers]
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        for (a, c), (k, _) in zip(layers, saved, strict=True):
            a.write(c, slots, *(_finite(k.shape, k.dtype, g).to(c.device) for _ in range(2)))
        first, later = template_batches(accessors[0].block_size, caches[0].device, widths.labels)
        scratch = torch.zeros((), dtype=torch.long, device=caches[0].device)  # the non-finite count, not the worker's
        with recording() as recorded:
            held = compress_region(caches, accessors, [None] * len(caches), first, setup, nonfinite=scratch,
                                   codecs=codecs)
            compress_region(caches, accessors, held, later, setup, nonfinite=scratch, codecs=codecs)
    finally:
        for (a, c), (k, v) in zip(layers, saved, strict=True):
            a.write(c, slots, k, v)
    compiled = variants(recorded, widths)
    for launch in compiled:
        launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
    return WarmupReport(widths, tuple(compiled), time.perf_counter() - start)


def warm_up_copy(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor]) -> WarmupReport:
    """The copy alone, for policies whose compressions no start-up template can run (they score the queries of a
    request's own prefill): one copy of the rows of blocks ``1 .. TEMPLATE_BLOCKS`` onto themselves in every layer
    (each row kept where it is: nothing changes), which compiles the copy's variant for these caches (it has one per
    layout: no width of it changes with a compression's size). Nothing where the copy is not one launch (caches other
    than paged views: the PyTorch path copies)."""
    start = time.perf_counter()
    recorded: list[Launch] = []
    if all(isinstance(a, PagedAccessor) for a in accessors):
        device = caches[0].device
        slots = slots_of(torch.arange(1, 1 + TEMPLATE_BLOCKS, device=device), accessors[0].block_size)
        n = slots.numel()
        positions = torch.arange(n, device=device).view(1, 1, n).expand(1, caches[0].shape[1], n)
        with recording() as recorded:
            copy_triton.copy_kept(caches, positions, [0] * len(caches), slots, slots)
    return WarmupReport(WarmupWidths((), (), (), False), tuple(recorded), time.perf_counter() - start)


def compiled_variants() -> int | None:
    """Kernel variants Triton holds compiled over every kernel a compression launches (its JIT caches), to check
    that nothing compiles after :func:`warm_up`; ``None`` where none compile (the interpreter) or where this Triton
    keeps them elsewhere."""
    kernels = [step_kernels.compiled(False, k) for k in step_kernels.NOT_SPECIALIZED]
    kernels += [cords_triton.compiled(False), copy_triton.compiled(False)]
    if not all(hasattr(k, "device_caches") for k in kernels):
        return None
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())
