"""The compress step in a fixed number of launches: one compression of one request, every anchor at once.

The kernel path beside its reference, :func:`~cords_vllm.compress.step.compress_region`'s PyTorch path (which stays
the CPU path and the reference this one is tested against), for the greedy D^2 family the greedy kernel runs
(:meth:`~cords_vllm.selection.base.Selector.greedy_params`: ``cords`` with either novelty in either space,
``k_only``, ``v_only``). Where the PyTorch path runs a hundred-odd small ops per compression (region tokens,
candidate ranks, frame ids, frame budget, centroids, the exact-count trim, the sort of kept positions, the held
tokens' gathers), this one runs seven launches whatever the granularity, layer count or anchor count (one more with an
fp8 cache, whose anchors' scales are gathered, one more in the normalized space, and on CUDA, where the region has
frame labels, the copy of their runs to the host, 4 bytes per problem, :class:`~.late_read.LateRead`):

1. :func:`_plan_kernel`, one program per problem (anchor, or anchor and KV head per head): the region's tokens
   (previously held, then entering), the recent window's protection, and the *units* the policy ranks: candidate
   tokens, full runs of ``group_size`` candidates (``block``), or labelled frames (``frame``: the edge frame kept
   whole when it is cut short, the other frames as units, and the fewest frames any choice of which holds the
   budget, :func:`~cords_vllm.selection.exact._frames_holding`'s rule, found by bisection over frame sizes rather
   than by sorting them).
2. :func:`_units_kernel`, one program per (problem, unit): the unit's mean key and value, read from the paged cache
   of its anchor layer (every anchor from one base pointer, as the copy addresses layers), non-finite entries read
   as 0, and its norms. Extra programs scan the whole region for non-finite entries when a counter is given.
3. Two batched GEMMs (the Gram matrices) and the greedy kernel
   (:func:`~cords_vllm.selection.cords_triton.greedy_from_units`).
4. :func:`_finish_kernel`, one program per problem: the exact-count rule
   (:func:`~cords_vllm.selection.exact.select_exact`: units in the order chosen, oldest token first, the unit chosen
   last trimmed), kept positions in row order, and the tokens the region now holds (ids, video, labels).
5. The copy (:func:`~cords_vllm.compress.copy_triton.copy_kept`).

A step's compressions (:func:`~cords_vllm.compress.step.compress_regions`) share steps 2-3: their units are written to
rows of one zero-filled buffer (each problem padded with invalid units to the step's largest unit count) and ordered
by one greedy run, ``4 N + 4`` launches for ``N`` compressions (:class:`~cords_vllm.compress.unit_rows.UnitRowsToMake`,
:class:`GreedyOnRows`), one
more where two or more of them read their frame stats back (:class:`StatsToRead`).
A compression's rows are padded with invalid units to a multiple of :data:`UNIT_ROWS` in any case.

Compiles: every kernel leaves the arguments that change from one compression to the next unspecialized
(:data:`NOT_SPECIALIZED`), so a compression of another size runs the kernels already compiled.

Host reads: none at block and token granularity. At frame granularity the host must size the units' buffers and the
greedy run by the frames a problem holds, which earlier compressions decided on the device. Where the batch gives the
entering labels' runs (:attr:`~cords_vllm.compress.step.RegionBatch.new_label_runs`, as the worker does) and the held
tokens came from the fused step (or there are none), it reads nothing: it sizes them by an upper bound
(:func:`_frames_bound`: the entering labels' runs plus the held rows' runs, which the finish program counts and the
host receives a compression late, :class:`~cords_vllm.compress.late_read.LateRead`), and the units program takes the
frame budget from the plan. A bound past the frames costs a few units that are never valid. Otherwise it reads the
plan's stats (the most frames a problem holds and the frame budget, a ``[P, 2]`` read), as the reference does: a
step's frame compressions read theirs together, one host sync per step (:class:`StatsToRead`), and what the host
prepares for the later launches without the plan's results is prepared before that read, while the plan runs.

Same kept tokens as the reference: the units' features are the same sums in another order, so they may differ in
their last bits; the greedy kernel's tie slack (:func:`~cords_vllm.selection.cords.snap_tolerance`) is there for
that (tested on CPU under ``TRITON_INTERPRET=1``, ``tests/compress/test_step_triton.py``).

Held tokens: the region's tokens after a compression are returned per layer as views of one ``[A, H', n]`` tensor
per field (``H' = 1`` for joint selection, expanded over the heads), so the next compression reads every anchor's
without a stack. Tokens held in another form (the PyTorch path's) are stacked first (a few launches, once).

The normalized space (``cords`` with ``space="normalized"``) adds one launch, :func:`_normalize_kernel`, which scales
every problem's units in place before the Gram GEMMs.

Joint selection under tensor parallelism (:func:`gathered_rows`): each rank makes its own heads' units, one
all-gather of the units' features (``4 * P * M * 2 * H_local * D`` bytes sent, ``M`` units: less than the PyTorch
path's gather of the region's keys and values, ``T >= M`` tokens) gives every rank all heads' units, and every rank
runs the same greedy run; four more launches (the units' copy into the rows the greedy run reads, and their norms
over all heads; three in the normalized space, whose scaling makes the norms), besides the collective's own.

Not covered (the PyTorch path runs them, with the launches it counts): other policies, caches other than the paged
views of vLLM's GPU backends, an anchor layer that follows another anchor, and problems past the greedy kernel's
limits. fp8 caches (e4m3, e5m2) are covered: the units kernel decodes their bytes with the layers' scales, as
:class:`~cords_vllm.compress.kv_codec.Fp8Codec` does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cords_vllm.compress import copy_triton
from cords_vllm.compress.gram_budget import problem_chunks
from cords_vllm.compress.kv_access import KVAccessor, PagedAccessor
from cords_vllm.compress.kv_codec import Fp8Codec, KVCodec, PlainCodec
from cords_vllm.compress.late_read import LateRead
from cords_vllm.compress.region import HeldTokens
from cords_vllm.compress.step_kernels import (
    BLOCK,
    FRAME,
    MAX_ROWS,
    TILE_ELEMENTS,
    TOKEN,
    compiled,
    row_width,
)
from cords_vllm.compress.unit_rows import UnitRows, UnitRowsToMake
from cords_vllm.kernel_backend import interpreting, launch
from cords_vllm.selection.cords_triton import GRAM_LIMIT_BYTES, MAX_UNITS, UNIT_ROWS, greedy_from_units
from cords_vllm.selection.greedy_params import GreedyParams
from cords_vllm.selection.together import SelectionSteps
from cords_vllm.utils import cdiv

try:
    import triton
except ImportError:
    triton = None

logger = logging.getLogger(__name__)


def not_covered(selector, accessors: Sequence[KVAccessor], caches: Sequence[torch.Tensor],
                codecs: Sequence[KVCodec] | None, anchor_of: Sequence[int]) -> str | None:
    """Why :func:`compress_region_fused_steps` does not run an engine's compressions (``None``: it does), for the
    start-up line and :func:`covers`; see the module docstring's "Not covered"."""
    anchors = sorted(set(anchor_of))
    if selector.greedy_params() is None:
        return f"{selector.name} is not the greedy D^2 run the kernels take (cords, k_only, v_only)"
    if not all(isinstance(a, PagedAccessor) for a in accessors):
        return "the KV cache is not the paged view of vLLM's GPU attention backends"
    first = caches[anchors[0]]
    fp8 = _fp8_mode(codecs, anchors)
    if fp8 is None or (fp8 == 0 and not (first.dtype.is_floating_point and first.element_size() <= 4)) or (
            fp8 and first.dtype != torch.uint8):
        return f"a KV cache of {first.dtype} the kernels do not decode"
    if any(copy_triton.cache_signature(caches[a]) != copy_triton.cache_signature(first) for a in anchors):
        return "the anchor layers' caches differ in layout"
    if any((caches[a].data_ptr() - first.data_ptr()) % first.element_size() for a in anchors):
        return "the anchor layers' caches are not element-aligned with each other"
    if any(anchor_of[a] != a for a in anchors):
        return "an anchor layer follows another anchor"
    return None


def covers(selector, accessors: Sequence[KVAccessor], caches: Sequence[torch.Tensor],
           codecs: Sequence[KVCodec] | None, anchor_of: Sequence[int]) -> bool:
    """Whether :func:`compress_region_fused_steps` runs this compression (:func:`not_covered` finds no reason)."""
    return not_covered(selector, accessors, caches, codecs, anchor_of) is None


#: The fp8 element types the units kernel decodes, by its ``FP8`` constant.
FP8_ELEMENTS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def _fp8_mode(codecs: Sequence[KVCodec] | None, anchors: Sequence[int]) -> int | None:
    """The units kernel's ``FP8`` for the anchors' codecs: 0 (floating caches), 1 / 2 (fp8, one element type), or
    ``None`` (a codec or mix it does not decode)."""
    if codecs is None or all(isinstance(codecs[a], PlainCodec) for a in anchors):
        return 0
    elements = {getattr(codecs[a], "element", None) for a in anchors}
    if len(elements) != 1 or not all(isinstance(codecs[a], Fp8Codec) for a in anchors):
        return None
    return FP8_ELEMENTS.get(elements.pop())


def _scales(codecs: Sequence[KVCodec], anchors: Sequence[int], heads: int, device: torch.device) -> torch.Tensor:
    """``float32 [A, 2, H]``: every anchor's key and value scale per head, in one launch (scales given as numbers are
    uploaded once per value). Tensor scales are read at each compression, so scales vLLM updates in place are seen."""
    parts = []
    for a in anchors:
        for scale in (codecs[a].k_scale, codecs[a].v_scale):
            if not isinstance(scale, torch.Tensor):
                scale = copy_triton.device_table((float(scale),), device, torch.float32)
            parts.append(scale.to(torch.float32).reshape(-1).expand(heads))
    return torch.cat(parts)


@functools.cache
def _handed_back(reason: str) -> None:
    """Say once per reason that a compression ran the PyTorch plumbing instead of the fused step; returns ``None``
    (what :func:`compress_region_fused_steps` returns then)."""
    logger.info("cords-vllm: a compression ran the greedy kernel and the copy, not the fused step: %s", reason)


def _stacked(held: Sequence, anchors: Sequence[int]):
    """Every anchor's held tokens as ``[A, H', n]`` tensors (ids, video, labels or ``None``): the views this module
    returned last time, read in place, else stacked."""
    fields = []
    for name in ("ids", "candidates", "labels"):
        parts = [getattr(held[a], name) for a in anchors]
        if parts[0] is None or any(x is None for x in parts):
            fields.append(None)
            continue
        root = parts[0]._base
        if root is not None and root.dim() == 3 and root.shape[0] == len(anchors) and all(
                x._base is root and x.data_ptr() == root[i].data_ptr() for i, x in enumerate(parts)):
            fields.append(root)
        else:
            fields.append(torch.stack(parts))
    return fields


@dataclass(frozen=True, eq=False)
class StatsToRead:
    """A fused compression's host read (:class:`~cords_vllm.selection.together.Stackable`): its plan's frame count
    and frame budget per problem (``stats``: ``int32 [P, 2]``, read as a list of ``[count, budget]`` pairs), or
    nothing (``None``, at block and token units: they yield too, so that a step's compressions reach their units'
    buffers and greedy run at the same point and share them). A step's reads are done together: one copy of all its
    frame compressions' stats and one host sync, whatever their number (each alone: a sync per compression, each
    waiting for the plans launched after the one before it)."""

    device: torch.device
    stats: torch.Tensor | None

    def stack_key(self) -> torch.device:
        return self.device

    def run(self) -> list[list[int]] | None:
        return None if self.stats is None else self.stats.tolist()

    @classmethod
    def run_stack(cls, items: Sequence[StatsToRead]) -> list[list[list[int]] | None]:
        reading = [i.stats for i in items if i.stats is not None]
        if len(reading) <= 1:
            return [i.run() for i in items]
        pairs = torch.cat(reading).tolist()  # one launch, one sync
        out, row = [], 0
        for item in items:
            if item.stats is None:
                out.append(None)
                continue
            out.append(pairs[row:row + item.stats.shape[0]])
            row += item.stats.shape[0]
        return out


@dataclass(frozen=True)
class GreedyOnRows:
    """The greedy run of a fused compression's units (:class:`~cords_vllm.selection.together.Stackable`): the Gram
    GEMMs and the greedy kernel on its rows, or once on the rows a step's compressions share. Returns
    ``long [P, K]`` (``K >= k_max``, at least 1 column)."""

    rows: UnitRows
    width: int
    k_max: int
    params: GreedyParams

    def stack_key(self) -> tuple | None:
        return None if self.rows.stack is None else (id(self.rows.stack), self.params)

    def run(self) -> torch.Tensor:
        return _greedy(self.rows, self.width, self.k_max, self.params)

    @classmethod
    def run_stack(cls, items: Sequence[GreedyOnRows]) -> list[torch.Tensor]:
        first = items[0]
        order = _greedy(first.rows.stack, first.width, max(i.k_max for i in items), first.params)
        return [order[i.rows.start:i.rows.stop] for i in items]


def _greedy(rows: UnitRows, width: int, k_max: int, params: GreedyParams) -> torch.Tensor:
    """The greedy run on ``rows``, in consecutive groups of problems whose Gram matrices stay under the step's
    limit (:mod:`cords_vllm.compress.gram_budget`; one group, one launch sequence, when they fit)."""
    if k_max == 0:
        return torch.empty((rows.k.shape[0], 1), dtype=torch.long, device=rows.k.device)  # never read
    if params.space == "normalized":  # one more launch: every problem's units scaled, their norms made again
        _normalize(rows.feats, rows.norms, rows.valid, rows.feats.shape[1], width, interpreting())
    chunks = problem_chunks(rows.k.shape[0], rows.feats.shape[1])
    orders = []
    for start, stop in chunks:
        kn, vn, seed = rows.norms[:, start:stop].unbind(0)
        orders.append(greedy_from_units(rows.feats[start:stop], width, kn, vn, seed, rows.valid[start:stop],
                                        rows.k[start:stop], k_max, params))
    return orders[0] if len(orders) == 1 else torch.cat(orders)


def gathered_rows(local: UnitRows, gather, heads: int, head_size: int, interp: bool, norms: bool = True
                   ) -> SelectionSteps[tuple[UnitRows, int]]:
    """This rank's units (``local``: its ``heads`` KV heads) with every rank's heads, in the rows the greedy run reads:
    one all-gather of the units' features (``float32 [P, M, 2 * heads * head_size]``, keys then values, in the
    model's head order, as :mod:`~cords_vllm.compress.tensor_parallel` lays them out), their validity and budgets
    copied, their norms made again over all heads (the normalize kernel without the scaling; not with ``norms``
    false, where the greedy run scales the units and makes their norms anyway). Every rank runs
    the same plan, so all call the collective at the same point with the same shape, and all order the same units.
    Returns the rows and the width of their keys."""
    p_count, m_units, _ = local.feats.shape
    full = gather(local.feats.view(p_count, m_units, 2, heads, 1, head_size))  # [P, M, 2, H_all, 1, D]
    width = full.shape[3] * head_size
    rows = yield UnitRowsToMake(local.feats.device, p_count, m_units, width)
    rows.feats[:, :m_units].view(p_count, m_units, 2, -1, 1, head_size).copy_(full)
    rows.valid[:, :m_units].copy_(local.valid)
    rows.k.copy_(local.k)
    if norms:
        _normalize(rows.feats, rows.norms, rows.valid, m_units, width, interp, scale=False)
    return rows, width


def _normalize(feats: torch.Tensor, norms: torch.Tensor, valid: torch.Tensor, m_units: int, width: int,
               interp: bool, scale: bool = True) -> None:
    """the normalize kernel on ``P`` problems' rows (``feats`` ``[P, M', 2 * width]``, ``norms`` ``[3, P, M']``,
    ``valid`` ``[P, M']``, rows contiguous; the first ``m_units`` units of each)."""
    block_w = max(16, triton.next_power_of_2(width))
    launch("normalize", compiled(interp, "normalize"), (feats.shape[0],),
        feats, norms, valid, m_units, width, feats.stride(0), norms.stride(0), norms.stride(1), valid.stride(0),
        SCALE=scale, BLOCK_S=max(1, 4096 // block_w), BLOCK_W=block_w)


def _frames_bound(held: Sequence, anchors: Sequence[int], batch, n_prev: int, n_cand: int) -> int | None:
    """An upper bound on the frames (units) of any problem of a frame compression, from what the host holds, or
    ``None`` (the plan's stats are read back instead).

    A frame is a run of equal labels among the region's candidates, a subsequence of the region's video rows, which
    are the held rows' then the entering ones'; a subsequence has no more runs than its sequence (nor than the runs
    of consecutive video rows, :func:`~cords_vllm.compress.frames.label_runs`, which text rows only split), and a
    concatenation no more than its parts together. So the frames are at most the held rows' runs (counted by the
    previous compression's finish program, :attr:`~cords_vllm.compress.step.HeldTokens.label_runs`, read a
    compression late) plus the entering rows' (``batch.new_label_runs``, counted by the host), and at most the
    candidates."""
    if batch.new_label_runs is None:
        return None
    runs = batch.new_label_runs
    if n_prev:
        late = {id(held[a].label_runs): held[a].label_runs for a in anchors}
        if None in late.values():
            return None
        held_runs = max(max(r.values()) for r in late.values())
        if held_runs < 0:
            raise RuntimeError("the fused step's last compression of this request held more frames than the host's "
                               "bound on them; it kept its oldest candidates instead of a selection")
        runs += held_runs
    return max(1, min(runs, n_cand))


def compress_region_fused_steps(caches: Sequence[torch.Tensor], held: Sequence, batch, setup,
                                nonfinite: torch.Tensor | None, codecs: Sequence[KVCodec] | None = None
                                ) -> SelectionSteps[list | None]:
    """:func:`~cords_vllm.compress.step.compress_region` (same arguments, same result) in seven launches (one more
    with an fp8 cache, one more in the normalized space), as a generator (:mod:`~cords_vllm.selection.together`): a
    step's fused compressions share their units' buffers and one greedy run (the two Gram GEMMs and the greedy kernel
    for all of them: ``4 N + 4`` launches for ``N`` compressions, one more where two or more read frame stats back,
    in one host sync).

    Returns ``None``, before anything is written (the caller then runs the PyTorch path): the region exceeds
    :data:`MAX_ROWS` or the problem the greedy kernel's limits, or a layer holds other tokens than its anchor (held
    tokens not shared the way this step and the reference return them). The caller checks :func:`covers` first."""
    anchors = setup.anchors
    if any(held[layer] is not held[setup.anchor_of[layer]] for layer in range(len(caches))):
        return _handed_back("a layer holds other tokens than its anchor")  # only the reference gathers per layer
    first = caches[anchors[0]]
    device = first.device
    _, heads, _, channels = first.shape
    per_head = setup.per_head
    hp = heads if per_head else 1
    n_prob = len(anchors) * hp
    unit = batch.unit(setup)
    need, n_cand = batch.num_keep_candidates, batch.num_candidates
    if not 0 <= need < n_cand:
        raise ValueError(f"need: must be in [0, {n_cand}) (the candidate count), got {need}")
    width = heads * (channels // 2) if not per_head else channels // 2
    n_prev = 0 if held[anchors[0]] is None else held[anchors[0]].ids.shape[1]
    n_tok = n_prev + batch.new_ids.shape[0]
    if n_tok > MAX_ROWS:
        return _handed_back(f"a region of more than {MAX_ROWS} rows")
    empty_long = torch.empty(1, dtype=torch.long, device=device)
    held_rows = _held_rows(held, anchors, n_prev, empty_long)
    labels = batch.new_labels is not None and (n_prev == 0 or held_rows[2] is not None)  # as the reference's
    mode = _unit_mode(unit, labels, batch.group_size, need, n_cand)
    if mode != FRAME and (n_cand if mode == TOKEN else n_cand // batch.group_size) > MAX_UNITS:
        return _handed_back(f"more than {MAX_UNITS} units")
    block_t = max(16, triton.next_power_of_2(n_tok))
    interp = interpreting()
    plan = _launch_plan(batch, held_rows, n_prev, n_tok, hp, n_prob, labels, mode, block_t, interp, empty_long)

    # What needs nothing the plan computes is worked out while it runs, before the frame mode's read waits for it.
    params = setup.selector.greedy_params()
    gather = None if per_head else setup.gather_heads
    scan = nonfinite is not None
    reads = _CacheReads.of(caches, anchors, codecs, width, empty_long)
    scan_programs = cdiv(n_tok, reads.tile_rows) if scan else 0
    bound = _frames_bound(held, anchors, batch, n_prev, n_cand) if mode == FRAME else None
    read = mode == FRAME and bound is None
    per_problem = yield StatsToRead(device, plan.stats if read else None)  # with the step's other reads
    m_units, k_max, frame_budget = _unit_counts(mode, batch, per_problem if read else None, bound)
    if m_units > MAX_UNITS or n_prob * m_units * m_units * 8 > GRAM_LIMIT_BYTES:
        return _handed_back(f"more than {MAX_UNITS} units or {GRAM_LIMIT_BYTES >> 30} GiB of Gram matrices")

    unit_rows = cdiv(max(m_units, 1), UNIT_ROWS) * UNIT_ROWS  # the units' rows, padded with invalid units
    to_make = UnitRowsToMake(device, n_prob, unit_rows, width)
    # Under tensor parallelism (joint selection) this rank's units are made alone, then gathered with the other
    # ranks' heads into the rows the greedy run reads; otherwise made in those rows.
    rows = (yield to_make) if gather is None else to_make.run()
    _launch_units(first, reads, batch.src_slots, plan, rows, hp, n_tok, unit_rows, scan_programs, frame_budget,
                  k_max, mode, per_head, scan, interp)
    if gather is not None:
        rows, width = yield from gathered_rows(rows, gather, heads, channels // 2, interp,
                                                norms=params.space != "normalized")

    order = yield GreedyOnRows(rows, width, k_max, params)
    return _finish(caches, setup, batch, plan, order, rows.k, nonfinite, (len(anchors), hp, heads), n_tok, m_units,
                   k_max, labels, block_t, interp, empty_long)


def _held_rows(held: Sequence, anchors: Sequence[int], n_prev: int, empty_long: torch.Tensor) -> tuple:
    """The held tokens as the plan program reads them: ``(ids, video, labels, hs_a, hs_h)``, each field
    ``[A, H', n_prev]`` (:func:`_stacked`; ``labels`` ``None`` where they have none) with its anchor and head strides
    (the head stride 0 where ``H' = 1``: one row per anchor, shared by its heads). With nothing held (a first
    compression), placeholders in the held tokens' types (one variant for both)."""
    if not n_prev:
        return empty_long, empty_long.view(torch.bool)[:1], None, 0, 0
    h_ids, h_video, h_labels = _stacked(held, anchors)
    hs_a, hs_h = h_ids.stride(0), h_ids.stride(1)
    if h_video.stride()[:2] != (hs_a, hs_h) or (h_labels is not None and h_labels.stride()[:2] != (hs_a, hs_h)):
        h_ids, h_video = h_ids.contiguous(), h_video.contiguous()
        h_labels = None if h_labels is None else h_labels.contiguous()
        hs_a, hs_h = h_ids.stride(0), h_ids.stride(1)
    if h_ids.shape[1] == 1:
        hs_h = 0
    return h_ids, h_video, h_labels, hs_a, hs_h


def _unit_mode(unit: str, labels: bool, group: int | None, need: int, n_cand: int) -> int:
    """The plan program's ``MODE`` for a compression's ``unit``: labelled frames (``FRAME``, where the region has
    labels), runs of ``group`` candidates (``BLOCK``), or tokens (``TOKEN``: at token units, without a group size, or
    where the budget of ``need`` tokens covers more runs than the ``n_cand`` candidates hold)."""
    if unit == "frame" and labels:
        if group is None:
            raise ValueError("group_size: required (the largest frame, in tokens) at frame granularity")
        return FRAME
    if unit == "token" or group is None or cdiv(need, group) > n_cand // group:
        return TOKEN
    return BLOCK


@dataclass(frozen=True, eq=False)
class _PlanRows:
    """What the plan program writes for the later ones, each problem a row: ``[P, T]`` rows of the region
    (``ids`` and ``labels`` ``long``, ``video`` ``bool``; ``labels`` a 1-element placeholder without labels), the
    candidates' ranks (``elig_rank``), units (``unit_of``) and rows by rank (``row_of_rank``), the units' first ranks
    and sizes (``unit_start``, ``unit_size``), all ``int32``, the protected rows (``protect``, ``bool``) and the
    finish program's scratch (``kept_count``, ``int32``); ``int32 [P]``: the units (``count``) and the tokens they
    must keep (``still``); ``stats`` (``int32 [P, 2]``: frames, and frames holding the budget) and ``flag``
    (``int32 [1]``: a non-finite entry seen)."""

    ids: torch.Tensor
    video: torch.Tensor
    labels: torch.Tensor
    elig_rank: torch.Tensor
    unit_of: torch.Tensor
    row_of_rank: torch.Tensor
    unit_start: torch.Tensor
    unit_size: torch.Tensor
    kept_count: torch.Tensor
    protect: torch.Tensor
    count: torch.Tensor
    still: torch.Tensor
    stats: torch.Tensor
    flag: torch.Tensor


def _launch_plan(batch, held_rows: tuple, n_prev: int, n_tok: int, hp: int, n_prob: int, labels: bool, mode: int,
                 block_t: int, interp: bool, empty_long: torch.Tensor) -> _PlanRows:
    """The plan program on ``n_prob`` problems (``hp`` per anchor) of ``n_tok`` rows (``n_prev`` held:
    :func:`_held_rows`, then ``batch``'s entering tokens), at unit ``mode``, ``block_t`` lanes wide."""
    device = empty_long.device

    def buf(dtype: torch.dtype, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    region_ids, region_video = buf(torch.long, n_prob, n_tok), buf(torch.bool, n_prob, n_tok)
    region_labels = buf(torch.long, n_prob, n_tok) if labels else empty_long
    elig_rank, unit_of, row_of_rank = (buf(torch.int32, n_prob, n_tok) for _ in range(3))
    unit_start, unit_size, kept_count = (buf(torch.int32, n_prob, n_tok) for _ in range(3))
    plan = _PlanRows(region_ids, region_video, region_labels, elig_rank, unit_of, row_of_rank, unit_start, unit_size,
                     kept_count, buf(torch.bool, n_prob, n_tok), buf(torch.int32, n_prob), buf(torch.int32, n_prob),
                     buf(torch.int32, n_prob, 2), buf(torch.int32, 1))
    h_ids, h_video, h_labels, hs_a, hs_h = held_rows
    spans = batch.spans.contiguous()
    launch("plan", compiled(interp, "plan"), (n_prob,),
        h_ids, h_video, h_labels if h_labels is not None else empty_long, hs_a, hs_h,
        batch.new_ids.contiguous(), batch.new_labels.contiguous() if batch.new_labels is not None else empty_long,
        spans, spans.shape[0], plan.ids, plan.video, plan.labels, plan.elig_rank, plan.unit_of, plan.row_of_rank,
        plan.unit_start, plan.unit_size, plan.protect, plan.count, plan.still, plan.stats, plan.flag,
        n_prev, n_tok, hp, batch.num_recent, batch.num_keep_candidates, batch.group_size or 1,
        MODE=mode, LABELS=labels, **row_width(block_t))
    return plan


@dataclass(frozen=True, eq=False)
class _CacheReads:
    """How the units program reads the anchors' caches (worked out while the plan runs): every anchor's element
    offset from the first's (``offsets``, a device table), the first's strides (block, head, offset, channel) and
    access alignment (``align``, :func:`~cords_vllm.compress.copy_triton.alignment`), the fp8 decoding (``fp8``,
    :func:`_fp8_mode`) and ``scales`` (``float32 [A, 2, H]``, a placeholder without it), and the program's lanes: a
    unit's channels (``block_f``) and tokens read at once (``tile_rows``)."""

    offsets: torch.Tensor
    strides: tuple[int, ...]
    align: int
    fp8: int
    scales: torch.Tensor
    block_f: int
    tile_rows: int

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor], anchors: Sequence[int], codecs: Sequence[KVCodec] | None,
           width: int, empty_long: torch.Tensor) -> _CacheReads:
        first = caches[anchors[0]]
        starts = tuple(caches[a].data_ptr() - first.data_ptr() for a in anchors)  # bytes
        offsets = copy_triton.device_table(tuple(s // first.element_size() for s in starts), first.device)  # once
        block_f = max(16, triton.next_power_of_2(width))
        fp8 = _fp8_mode(codecs, anchors)
        scales = _scales(codecs, anchors, first.shape[1], first.device) if fp8 else empty_long
        return cls(offsets, first.stride(), copy_triton.alignment(first, starts, first.shape[3] // 2), fp8, scales,
                   block_f, max(1, TILE_ELEMENTS // block_f))


def _unit_counts(mode: int, batch, per_problem: list[list[int]] | None, bound: int | None) -> tuple[int, int, int]:
    """``(m_units, k_max, frame_budget)``: the most units of a problem, the most it chooses, and the units program's
    frame budget (0 but at frame units). Frames sized by the host's ``bound`` (``per_problem`` ``None``: the units
    program reads the budget from the plan, ``-1``, unless the batch gives it), else by the plan's ``[count,
    budget]`` per problem, read back."""
    need, n_cand, group = batch.num_keep_candidates, batch.num_candidates, batch.group_size
    if mode == FRAME and per_problem is None:  # sized by the host's bound; the units kernel reads the budget
        k_max = bound if batch.frame_budget is None else min(batch.frame_budget, bound)
        return bound, k_max, -1 if batch.frame_budget is None else batch.frame_budget
    if mode == FRAME:  # the compression's one host read: the most frames of a problem, and the frame budget
        m_units = max(c for c, _ in per_problem)
        frame_budget = batch.frame_budget if batch.frame_budget is not None else max(b for _, b in per_problem)
        return m_units, frame_budget * (m_units > frame_budget), frame_budget
    if mode == BLOCK:
        return n_cand // group, cdiv(need, group) * (n_cand > cdiv(need, group) * group), 0
    return n_cand, need, 0  # need < n_cand: never a covering budget


def _launch_units(first: torch.Tensor, reads: _CacheReads, src_slots: torch.Tensor, plan: _PlanRows,
                  rows: UnitRows, hp: int, n_tok: int, unit_rows: int, scan_programs: int, frame_budget: int,
                  k_max: int, mode: int, per_head: bool, scan: bool, interp: bool) -> None:
    """The units program: every problem's ``unit_rows`` units into ``rows`` (and ``scan_programs`` more programs
    scanning the region for non-finite entries), read from the anchors' caches (``first``'s layout, ``reads``)."""
    n_prob, heads, block_size, channels = plan.count.shape[0], first.shape[1], first.shape[2], first.shape[3]
    kn, vn, seed = rows.norms.unbind(0)
    launch("units", compiled(interp, "units"), (n_prob, unit_rows + scan_programs),
        first, reads.offsets, reads.scales, src_slots.contiguous(), plan.row_of_rank, plan.unit_start,
        plan.unit_size, plan.count, rows.feats, kn, vn, seed, rows.valid, rows.k, plan.flag, plan.stats, n_prob,
        n_tok, unit_rows, rows.feats.shape[1], hp, heads, channels // 2, frame_budget, k_max, *reads.strides,
        MODE=mode, PER_HEAD=per_head, SCAN=scan, FP8=reads.fp8, BLOCK_SIZE=block_size, ALIGN=reads.align,
        BLOCK_F=reads.block_f, TILE_T=reads.tile_rows)


def _finish(caches: Sequence[torch.Tensor], setup, batch, plan: _PlanRows, order: torch.Tensor, k: torch.Tensor,
            nonfinite: torch.Tensor | None, sizes: tuple[int, int, int], n_tok: int, m_units: int, k_max: int,
            labels: bool, block_t: int, interp: bool, empty_long: torch.Tensor) -> list[HeldTokens]:
    """The finish program (the kept rows of each problem, in order, and the tokens they hold), the copy of every
    layer's kept rows, and what each layer holds after (views of ``[A, H', num_keep]`` tensors, expanded over the
    ``heads``). ``sizes``: ``(anchors, problems per anchor H', heads)``; ``order``: ``long [P, >= k_max]``, the
    greedy run's units; ``k``: ``long [P]``, how many each problem chose."""
    n_anchor, hp, heads = sizes
    n_prob, num_keep, device = n_anchor * hp, batch.num_keep, empty_long.device
    shape = (n_anchor, hp, num_keep)  # the held tokens' views below keep this root
    positions = torch.empty(shape, dtype=torch.long, device=device)
    out_ids = torch.empty(shape, dtype=torch.long, device=device)
    out_video = torch.empty(shape, dtype=torch.bool, device=device)
    out_labels = torch.empty(shape, dtype=torch.long, device=device) if labels else empty_long
    runs = torch.empty(n_prob, dtype=torch.int32, device=device) if labels else empty_long
    launch("finish", compiled(interp, "finish"), (n_prob,),
        order, k, plan.still, plan.count, plan.elig_rank, plan.unit_of, plan.unit_start, plan.unit_size, plan.protect,
        plan.ids, plan.video, plan.labels, plan.kept_count, positions, out_ids, out_video, out_labels,
        plan.flag, nonfinite if nonfinite is not None else empty_long, runs,
        n_tok, max(m_units, 1), k_max, order.stride(0), num_keep,
        LABELS=labels, SCAN=nonfinite is not None, **row_width(block_t))

    positions = positions.expand(n_anchor, heads, num_keep)
    row_of = {a: i for i, a in enumerate(setup.anchors)}
    anchor_row = [row_of[setup.anchor_of[layer]] for layer in range(len(caches))]
    copy_triton.copy_kept(caches, positions, anchor_row, batch.src_slots, batch.dst_slots)
    out_labels = out_labels if labels else None
    label_runs = LateRead.of(runs) if labels else None  # for the next compression's bound, on its way to the host
    kept = [HeldTokens(out_ids[i].expand(heads, -1), out_video[i].expand(heads, -1),
                       None if out_labels is None else out_labels[i].expand(heads, -1), label_runs)
            for i in range(n_anchor)]
    return [kept[row] for row in anchor_row]
