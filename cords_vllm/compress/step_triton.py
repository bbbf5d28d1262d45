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
by one greedy run, ``4 N + 4`` launches for ``N`` compressions (:class:`UnitRowsToMake`, :class:`GreedyOnRows`), one
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
from cords_vllm.kernel_backend import interpreting, launch
from cords_vllm.selection.cords_triton import GRAM_LIMIT_BYTES, MAX_UNITS, UNIT_ROWS, greedy_from_units
from cords_vllm.selection.greedy_params import GreedyParams
from cords_vllm.selection.together import SelectionSteps
from cords_vllm.utils import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

logger = logging.getLogger(__name__)

#: Unit modes of :func:`_plan_kernel`: candidate tokens, fixed runs of ``group_size`` candidates, labelled frames.
TOKEN, BLOCK, FRAME = 0, 1, 2
#: Elements of keys (and as many of values) a units program reads at once: this over the features' width in rows
#: (4 rows of a 7B model's 4 heads x 128), 16 per thread of its 4 warps, so it spills no registers (64 rows spilled
#: 6.7 KB per thread on sm_90). A unit's tokens are summed that many at a time (a frame of 256 tokens: 64 dependent
#: steps, not 256), and each non-finite scanning program reads that many rows.
TILE_ELEMENTS = 2048
#: The most rows a region may have on the fused step: the plan and finish programs hold a region's rows in one
#: program (a 7B model's default region is 7,744). Larger regions run the PyTorch plumbing around the kernels.
MAX_ROWS = 32768


def _plan_kernel(held_ids, held_video, held_labels, hs_a, hs_h, new_ids, new_labels, spans, n_spans,
                 region_ids, region_video, region_labels, elig_rank, unit_of, row_of_rank, unit_start, unit_size,
                 protect, count_out, still_out, stats, flag,
                 n_prev, n_tok, heads_per_problem, num_recent, need, group,
                 MODE: tl.constexpr, LABELS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Problem ``p``'s region tokens and units. Per-problem outputs are rows of ``[P, T]`` (``stats``: ``[P, 2]``,
    the problem's frame count and frames holding ``need`` at frame granularity)."""
    p = tl.program_id(0).to(tl.int64)
    a = p // heads_per_problem
    h = p % heads_per_problem
    if p == 0:
        tl.store(flag, 0)
    t = tl.arange(0, BLOCK_T)
    inside = t < n_tok
    held = inside & (t < n_prev)
    entering = inside & (t >= n_prev)
    row = p * n_tok
    h_at = a * hs_a + h * hs_h + t
    ids = tl.where(held, tl.load(held_ids + h_at, mask=held, other=0),
                   tl.load(new_ids + (t - n_prev), mask=entering, other=0))
    in_span = tl.zeros([BLOCK_T], dtype=tl.int1)
    for s in range(0, n_spans):
        lo = tl.load(spans + 2 * s)
        hi = tl.load(spans + 2 * s + 1)
        in_span = in_span | ((ids >= lo) & (ids < hi))
    video = tl.where(held, tl.load(held_video + h_at, mask=held, other=0) != 0, in_span) & inside
    tl.store(region_ids + row + t, ids, mask=inside)
    tl.store(region_video + row + t, video, mask=inside)
    labels = tl.zeros([BLOCK_T], dtype=tl.int64)
    if LABELS:
        labels = tl.where(held, tl.load(held_labels + h_at, mask=held, other=0),
                          tl.load(new_labels + (t - n_prev), mask=entering, other=0))
        tl.store(region_labels + row + t, labels, mask=inside)

    # The recent window: the newest num_recent video tokens are protected this time.
    v = video.to(tl.int32)
    after = tl.sum(v, 0) - tl.cumsum(v, 0) + v  # video tokens at or after each row
    sel = video & (after > num_recent)
    elig = sel
    still = need
    kept_whole = tl.zeros([BLOCK_T], dtype=tl.int1)
    if MODE == 2:  # the newest frame, cut short by the region's edge, is kept whole
        low = -9223372036854775807
        newest = tl.max(tl.where(sel, labels, low), 0)
        edge = sel & (labels == newest)
        n_edge = tl.sum(edge.to(tl.int32), 0)
        kept_whole = edge & (n_edge < group) & (n_edge < need)
        elig = sel & ~kept_whole
        still = need - tl.sum(kept_whole.to(tl.int32), 0)
    e = elig.to(tl.int32)
    rank = tl.where(elig, tl.cumsum(e, 0) - 1, -1)
    n_elig = tl.sum(e, 0)
    tl.store(elig_rank + row + t, rank, mask=inside)
    tl.store(protect + row + t, inside & (~sel | kept_whole), mask=inside)
    tl.store(row_of_rank + row + rank, t, mask=elig)
    u = t  # unit slots, as wide as the rows
    if MODE == 0:
        unit = rank
        count = n_elig
        tl.store(unit_start + row + u, u, mask=u < count)
        tl.store(unit_size + row + u, tl.full([BLOCK_T], 1, tl.int32), mask=u < count)
    elif MODE == 1:
        count = n_elig // group
        unit = tl.where(elig & (rank < count * group), rank // group, -1)
        tl.store(unit_start + row + u, u * group, mask=u < count)
        tl.store(unit_size + row + u, tl.full([BLOCK_T], 0, tl.int32) + group, mask=u < count)
    else:  # a frame starts where an eligible token's label differs from the previous eligible token's
        tl.debug_barrier()  # row_of_rank and the labels are read back below
        prev_row = tl.load(row_of_rank + row + rank - 1, mask=elig & (rank > 0), other=0)
        prev_label = tl.load(region_labels + row + prev_row, mask=elig & (rank > 0), other=0)
        first = elig & ((rank == 0) | (labels != prev_label))
        f = first.to(tl.int32)
        unit = tl.where(elig, tl.cumsum(f, 0) - 1, -1)
        count = tl.sum(f, 0)
        tl.store(unit_start + row + unit, rank, mask=first)
        tl.debug_barrier()
        start = tl.load(unit_start + row + u, mask=u < count, other=0)
        nxt = tl.load(unit_start + row + u + 1, mask=u + 1 < count, other=0)
        size = tl.where(u + 1 < count, nxt, n_elig) - start
        tl.store(unit_size + row + u, size, mask=u < count)
        # The fewest frames any choice of which holds `still` tokens: as many of the smallest frames as reach it.
        # Without a sort (whose network takes a minute to compile at a 7B region's width): the smallest size v
        # whose frames up to that size hold `still` (a bisection), the frames below it, and of size v what is left.
        sizes = tl.where(u < count, size, 0)
        lo = tl.max(sizes, 0) * 0 + 1
        hi = tl.maximum(tl.max(sizes, 0), 1)
        while lo < hi:  # as many steps as the largest frame's size has bits (9 for 256 tokens)
            mid = (lo + hi) // 2
            enough = tl.sum(tl.where(sizes <= mid, sizes, 0), 0) >= still
            hi = tl.where(enough, mid, hi)
            lo = tl.where(enough, lo, mid + 1)
        below = (sizes > 0) & (sizes < lo)
        holding = tl.sum(below.to(tl.int32), 0) + (still - tl.sum(tl.where(below, sizes, 0), 0) + lo - 1) // lo
        holding = tl.where(tl.sum(sizes, 0) < still, count, holding)
        holding = tl.minimum(tl.where(still <= 0, 1, holding), count)
        tl.store(stats + 2 * p, count)
        tl.store(stats + 2 * p + 1, holding)
    tl.store(unit_of + row + t, unit, mask=inside)
    tl.store(count_out + p, count)
    tl.store(still_out + p, still)


def _e4m3(b):
    """fp32 values of e4m3fn bytes (``uint8``; NaN bytes decode as numbers: the caller masks them), exactly: normal
    numbers rebuilt as fp32 bits (exponent bias 7 -> 127), subnormals ``m * 2^-9``, the sign set as a bit (so the
    byte of -0 is -0: Triton 3.6, on GPU hosts, negates a float as ``0 - x``, which gives +0)."""
    b = b.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return (magnitude.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


def _e5m2(b):
    """fp32 values of e5m2 bytes (``uint8``), exactly: an e5m2 byte is the high byte of the fp16 with its value."""
    return (b.to(tl.int16) << 8).to(tl.float16, bitcast=True).to(tl.float32)


def _units_kernel(base, layer_offsets, scales, src_slots, row_of_rank, unit_start, unit_size, count_in,
                  feats, kn_out, vn_out, seed_out, valid_out, k_out, flag, stats, n_problems,
                  n_tok, m_units, m_stride, heads_per_problem, heads, head_size, frame_budget, k_fixed,
                  s_block, s_head, s_offset, s_channel,
                  MODE: tl.constexpr, PER_HEAD: tl.constexpr, SCAN: tl.constexpr, FP8: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_F: tl.constexpr, TILE_T: tl.constexpr, ALIGN: tl.constexpr):
    """Program ``(p, u)``: unit ``u``'s mean key and value (``feats[p, u]``, keys then values), their norms and the
    seed score, ``valid[p, u]``, and (``u == 0``) ``k[p]``; the outputs' rows are ``m_stride >= m_units`` units long
    (a step's compressions share them, each problem padded with invalid units). Programs ``u >= m_units`` (``SCAN``)
    look for non-finite entries in rows ``(u - m_units) * TILE_T ...`` of the region. A unit's tokens are read
    ``TILE_T`` at a time. ``frame_budget < 0`` (frames, the host did not read the plan's stats): the budget is the
    most frames any of the ``n_problems`` problems needs (``stats[:, 1]``), read here.

    ``FP8``: 0 for a floating cache; 1 (e4m3) or 2 (e5m2) for an fp8 cache read as bytes, decoded as
    :class:`~cords_vllm.compress.kv_codec.Fp8Codec` does (``scales``: ``float32 [A, 2, H]``, the keys' and the
    values' scale of every anchor and head). Bytes are decoded from their bits (:func:`_e4m3`, :func:`_e5m2`): exact,
    on every GPU (sm_80 has no e4m3 conversion) and in Triton's interpreter alike; a NaN (or e5m2 inf) byte is told
    from its bits too."""
    p = tl.program_id(0).to(tl.int64)
    u = tl.program_id(1)
    a = p // heads_per_problem
    cache = base + tl.multiple_of(tl.load(layer_offsets + a), ALIGN)  # ALIGN: as the copy's (16-byte accesses)
    f = tl.arange(0, BLOCK_F)
    width = head_size if PER_HEAD else heads * head_size
    in_f = f < width
    if PER_HEAD:
        head = p % heads_per_problem + f * 0
        channel = f
    else:
        head = f // head_size
        channel = f % head_size
    at = head.to(tl.int64) * s_head + channel.to(tl.int64) * s_channel
    v_at = at + head_size * s_channel
    k_scale = tl.load(scales + a * 2 * heads + head, mask=in_f, other=1.0) if FP8 else 1.0
    v_scale = tl.load(scales + a * 2 * heads + heads + head, mask=in_f, other=1.0) if FP8 else 1.0
    count = tl.load(count_in + p)
    if u < m_units:
        if u == 0:
            if MODE == 2:
                budget = frame_budget
                if frame_budget < 0:  # the plan's, as the host's read would have found it: the most of any problem
                    budget = frame_budget * 0
                    for q in range(0, n_problems):
                        budget = tl.maximum(budget, tl.load(stats + 2 * q + 1))
                # labelled frames: the budget covers a problem when it covers every frame
                k = tl.where(count <= budget, 0, budget)
            else:
                k = count * 0 + k_fixed
            tl.store(k_out + p, k.to(tl.int64))
        ok = u < count
        start = tl.load(unit_start + p * n_tok + u, mask=ok, other=0)
        size = tl.load(unit_size + p * n_tok + u, mask=ok, other=0)
        acc_k = tl.zeros([BLOCK_F], dtype=tl.float32)
        acc_v = tl.zeros([BLOCK_F], dtype=tl.float32)
        # A token's address is three dependent loads (its row, its slot, its channels). The tiles are pipelined so
        # that an iteration's loads are independent of each other: the channels of tile t, the slots of tile t + 1
        # (from rows read the iteration before) and the rows of tile t + 2, so a tile waits on one load, not three.
        # The sums are the same, in the same order.
        lane = tl.arange(0, TILE_T)
        ranks = row_of_rank + p * n_tok + start
        slot = tl.load(src_slots + tl.load(ranks + lane, mask=lane < size, other=0), mask=lane < size, other=0)
        rows = tl.load(ranks + TILE_T + lane, mask=TILE_T + lane < size, other=0)
        for j0 in range(0, size, TILE_T):  # TILE_T tokens at a time: their loads in flight together
            live = j0 + lane < size
            token = tl.multiple_of((slot // BLOCK_SIZE) * s_block + (slot % BLOCK_SIZE) * s_offset, ALIGN)[:, None]
            mask = live[:, None] & in_f[None, :]
            x = tl.load(cache + token + at[None, :], mask=mask, other=0)
            y = tl.load(cache + token + v_at[None, :], mask=mask, other=0)
            if FP8 == 0:
                x_ok, y_ok = mask, mask
                x, y = x.to(tl.float32), y.to(tl.float32)
            elif FP8 == 1:  # e4m3fn: NaN is S.1111.111
                x_ok, y_ok = mask & ((x & 0x7F) != 0x7F), mask & ((y & 0x7F) != 0x7F)
                x, y = _e4m3(x) * k_scale[None, :], _e4m3(y) * v_scale[None, :]
            else:  # e5m2: inf and NaN are S.11111.xx
                x_ok, y_ok = mask & ((x & 0x7C) != 0x7C), mask & ((y & 0x7C) != 0x7C)
                x, y = _e5m2(x) * k_scale[None, :], _e5m2(y) * v_scale[None, :]
            slot = tl.load(src_slots + rows, mask=j0 + TILE_T + lane < size, other=0)
            rows = tl.load(ranks + 2 * TILE_T + j0 + lane, mask=j0 + 2 * TILE_T + lane < size, other=0)
            acc_k += tl.sum(tl.where(x_ok & (x == x) & (tl.abs(x) < float("inf")), x, 0.0), 0)
            acc_v += tl.sum(tl.where(y_ok & (y == y) & (tl.abs(y) < float("inf")), y, 0.0), 0)
        n = tl.maximum(size, 1).to(tl.float32)
        key = tl.where(ok, acc_k / n, 0.0)
        value = tl.where(ok, acc_v / n, 0.0)
        out = (p * m_stride + u) * (2 * width)
        tl.store(feats + out + f, key, mask=in_f)
        tl.store(feats + out + width + f, value, mask=in_f)
        tl.store(kn_out + p * m_stride + u, tl.sqrt(tl.sum(key * key, 0)))
        tl.store(vn_out + p * m_stride + u, tl.sqrt(tl.sum(value * value, 0)))
        both = key + value
        tl.store(seed_out + p * m_stride + u, tl.sqrt(tl.sum(both * both, 0)))
        tl.store(valid_out + p * m_stride + u, ok.to(tl.int8))
    if SCAN:  # noqa: SIM102 (Triton: a constexpr branch around a runtime one)
        if u >= m_units:
            rows = (u - m_units) * TILE_T + tl.arange(0, TILE_T)
            live = rows < n_tok
            slot = tl.load(src_slots + rows, mask=live, other=0)
            token = tl.multiple_of((slot // BLOCK_SIZE) * s_block + (slot % BLOCK_SIZE) * s_offset, ALIGN)[:, None]
            mask = live[:, None] & in_f[None, :]
            x = tl.load(cache + token + at[None, :], mask=mask, other=0)
            y = tl.load(cache + token + v_at[None, :], mask=mask, other=0)
            if FP8 == 0:
                x_bad, y_bad = x != x, y != y
                x, y = x.to(tl.float32), y.to(tl.float32)
            elif FP8 == 1:
                x_bad, y_bad = (x & 0x7F) == 0x7F, (y & 0x7F) == 0x7F
                x, y = _e4m3(x) * k_scale[None, :], _e4m3(y) * v_scale[None, :]
            else:
                x_bad, y_bad = (x & 0x7C) == 0x7C, (y & 0x7C) == 0x7C
                x, y = _e5m2(x) * k_scale[None, :], _e5m2(y) * v_scale[None, :]
            bad = tl.sum(tl.sum((x_bad | y_bad | (x != x) | (tl.abs(x) == float("inf")) | (y != y)
                                 | (tl.abs(y) == float("inf"))).to(tl.int32), 1), 0)
            if bad > 0:
                tl.store(flag, 1)


def _finish_kernel(order, k_in, still_in, count_in, elig_rank, unit_of, unit_start, unit_size, protect,
                   region_ids, region_video, region_labels, kept_count, positions, out_ids, out_video, out_labels,
                   flag, nonfinite, runs_out,
                   n_tok, m_units, k_max, k_stride, num_keep,
                   LABELS: tl.constexpr, SCAN: tl.constexpr, BLOCK_T: tl.constexpr):
    """Problem ``p``'s kept rows (``positions[p]``, increasing) and the tokens the region holds after the copy
    (``order``'s rows are ``k_stride >= k_max`` long: a step's compressions share it). The chosen units take the
    rows' lanes too (``k_max <= m_units <= n_tok``): the budget sets no width, so it compiles no variant. With
    ``LABELS``, ``runs_out[p]``: the runs of equal labels among the kept rows' video tokens, as
    :func:`~cords_vllm.compress.frames.label_runs` counts them (an upper bound on the frames they hold, for the next
    compression's host, :class:`~cords_vllm.compress.late_read.LateRead`)."""
    p = tl.program_id(0).to(tl.int64)
    row = p * n_tok
    t = tl.arange(0, BLOCK_T)
    inside = t < n_tok
    k = tl.load(k_in + p)
    still = tl.load(still_in + p)
    # Tokens each chosen unit keeps: units in the order chosen fill `still`, the one crossing it is trimmed.
    tl.store(kept_count + row + t, tl.zeros([BLOCK_T], dtype=tl.int32), mask=t < m_units)
    tl.debug_barrier()
    s = tl.arange(0, BLOCK_T)
    chosen = (s < k) & (s < k_max)
    unit = tl.load(order + p * k_stride + s, mask=chosen, other=0)
    chosen = chosen & (unit >= 0)
    size = tl.load(unit_size + row + unit, mask=chosen, other=0)
    before = tl.cumsum(size, 0) - size
    take = tl.minimum(tl.maximum(still - before, 0), size)
    tl.store(kept_count + row + unit, take, mask=chosen)
    tl.debug_barrier()
    rank = tl.load(elig_rank + row + t, mask=inside, other=-1)
    mine = tl.load(unit_of + row + t, mask=inside, other=-1)
    has_unit = mine >= 0
    first = tl.load(unit_start + row + mine, mask=has_unit, other=0)
    quota = tl.load(kept_count + row + mine, mask=has_unit, other=0)
    kept = has_unit & (rank - first < quota)
    covered = (rank >= 0) & (rank < still)  # a budget that covers every unit (k == 0): the oldest `still` candidates
    # More units than the host sized the run by (its bound on the frames, which holds by construction; see
    # _frames_bound): the units past it were never ranked. Still exactly `num_keep` rows, so the copy reads only the
    # region: the oldest candidates, and -1 in runs_out, which the next compression's host raises on.
    short = tl.load(count_in + p) > m_units
    kept = tl.where((k == 0) | short, covered, kept)
    keep = inside & ((tl.load(protect + row + t, mask=inside, other=0) != 0) | kept)
    c = keep.to(tl.int32)
    at = tl.cumsum(c, 0) - 1
    out = p * num_keep + at
    tl.store(positions + out, t.to(tl.int64), mask=keep)
    tl.store(out_ids + out, tl.load(region_ids + row + t, mask=inside, other=0), mask=keep)
    tl.store(out_video + out, tl.load(region_video + row + t, mask=inside, other=0), mask=keep)
    if LABELS:
        tl.store(out_labels + out, tl.load(region_labels + row + t, mask=inside, other=0), mask=keep)
        tl.debug_barrier()  # the kept labels, written by other threads, are read back
        kept_row = p * num_keep
        held = t < num_keep
        label = tl.load(out_labels + kept_row + t, mask=held, other=0)
        before = tl.load(out_labels + kept_row + t - 1, mask=held & (t > 0), other=0)
        video = held & (tl.load(out_video + kept_row + t, mask=held, other=0) != 0)
        video_before = (t > 0) & (tl.load(out_video + kept_row + t - 1, mask=held & (t > 0), other=0) != 0)
        n_runs = tl.sum((video & (~video_before | (label != before))).to(tl.int32), 0)
        tl.store(runs_out + p, tl.where(short, -1, n_runs))
    if SCAN:  # noqa: SIM102 (Triton: a constexpr branch around a runtime one)
        if p == 0:
            tl.store(nonfinite, tl.load(nonfinite) + tl.load(flag).to(tl.int64))


def _unit_tile(valid, p, v_problem, m0, m_units, width, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Units ``[m0, m0 + BLOCK_S)`` of problem ``p``, as a tile of one component: the units (``[BLOCK_S]``), which
    are valid, the elements' offsets from the problem's first unit (``[BLOCK_S, BLOCK_W]``, rows of ``2 * width``)
    and the mask of the valid units' channels."""
    m = m0 + tl.arange(0, BLOCK_S)
    w = tl.arange(0, BLOCK_W)
    ok = (m < m_units) & (tl.load(valid + p * v_problem + m, mask=m < m_units, other=0) != 0)
    return m, ok, m[:, None].to(tl.int64) * (2 * width) + w[None, :], ok[:, None] & (w < width)[None, :]


def _normalize_kernel(feats, norms, valid, m_units, width, f_problem, n_field, n_problem, v_problem,
                      SCALE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Problem ``p``'s units in the normalized space, in place: its keys and its values each divided by their RMS
    spread over its valid units, as :func:`~cords_vllm.selection.cords.normalized_features` does (invalid units set
    to 0, a space with no spread left as it is), then their norms made again as the units kernel makes them.
    ``feats``: rows of ``2 * width`` (keys, values) ``f_problem`` apart; ``norms``: ``[3, P, M]`` (key, value, seed
    norms, ``n_field`` and ``n_problem`` apart); ``valid``: ``int8`` rows ``v_problem`` apart. Three passes over the
    units, ``BLOCK_S`` at a time: their sums, their spread, the scaled units. Without ``SCALE``, only the last: the
    norms of the units as they are."""
    p = tl.program_id(0).to(tl.int64)
    row = feats + p * f_problem
    scale_k = 1.0
    scale_v = 1.0
    if SCALE:
        sum_k = tl.zeros([BLOCK_W], dtype=tl.float32)
        sum_v = tl.zeros([BLOCK_W], dtype=tl.float32)
        count = tl.zeros([], dtype=tl.int32)
        for m0 in range(0, m_units, BLOCK_S):
            m, ok, at, mask = _unit_tile(valid, p, v_problem, m0, m_units, width, BLOCK_S, BLOCK_W)
            sum_k += tl.sum(tl.load(row + at, mask=mask, other=0.0), 0)
            sum_v += tl.sum(tl.load(row + at + width, mask=mask, other=0.0), 0)
            count += tl.sum(ok.to(tl.int32), 0)
        n = tl.maximum(count, 1).to(tl.float32)
        mean_k = sum_k / n
        mean_v = sum_v / n
        sq_k = tl.zeros([BLOCK_W], dtype=tl.float32)
        sq_v = tl.zeros([BLOCK_W], dtype=tl.float32)
        for m0 in range(0, m_units, BLOCK_S):
            m, ok, at, mask = _unit_tile(valid, p, v_problem, m0, m_units, width, BLOCK_S, BLOCK_W)
            dk = tl.where(mask, tl.load(row + at, mask=mask, other=0.0) - mean_k[None, :], 0.0)
            dv = tl.where(mask, tl.load(row + at + width, mask=mask, other=0.0) - mean_v[None, :], 0.0)
            sq_k += tl.sum(dk * dk, 0)
            sq_v += tl.sum(dv * dv, 0)
        spread_k = tl.sum(sq_k, 0) / n
        spread_v = tl.sum(sq_v, 0) / n
        scale_k = tl.where(spread_k > 0.0, 1.0 / tl.sqrt_rn(tl.where(spread_k > 0.0, spread_k, 1.0)), 1.0)
        scale_v = tl.where(spread_v > 0.0, 1.0 / tl.sqrt_rn(tl.where(spread_v > 0.0, spread_v, 1.0)), 1.0)
    for m0 in range(0, m_units, BLOCK_S):
        m, ok, at, mask = _unit_tile(valid, p, v_problem, m0, m_units, width, BLOCK_S, BLOCK_W)
        inside = m < m_units
        key = tl.where(mask, tl.load(row + at, mask=mask, other=0.0), 0.0) * scale_k
        value = tl.where(mask, tl.load(row + at + width, mask=mask, other=0.0), 0.0) * scale_v
        if SCALE:
            store = inside[:, None] & (tl.arange(0, BLOCK_W) < width)[None, :]
            tl.store(row + at, key, mask=store)
            tl.store(row + at + width, value, mask=store)
        both = key + value
        at_n = norms + p * n_problem + m
        tl.store(at_n, tl.sqrt(tl.sum(key * key, 1)), mask=inside)
        tl.store(at_n + n_field, tl.sqrt(tl.sum(value * value, 1)), mask=inside)
        tl.store(at_n + 2 * n_field, tl.sqrt(tl.sum(both * both, 1)), mask=inside)


def _row_warps(block_t: int) -> int:
    """Warps of the plan and finish programs, which hold a region's rows: enough that each thread holds at most 16 of
    a vector (a 7B model's 7,744-token region: 16 warps), up to 32. At 64 rows per thread (4 warps at 8,192 rows) the
    plan program spilled 2-3 KB of registers per thread on sm_90; at 16, at most 128 registers each, it spills a
    tenth of that."""
    return min(32, max(4, block_t // (32 * 16)))


def row_width(block_t: int) -> dict[str, int]:
    """The plan and finish programs' width at ``block_t`` rows (a power of two, at least 16): their ``BLOCK_T`` and
    warps, the only settings of theirs that change with a compression's size."""
    return {"BLOCK_T": block_t, "num_warps": _row_warps(block_t)}


#: Per kernel, the arguments Triton must not specialize, so that a compression of another size compiles nothing:
#: integers that change from one compression to the next (region and unit counts, budgets, the recent window, a
#: unit's tokens, strides of tensors sized by them), which Triton would otherwise compile a variant for at the value
#: 1 and at multiples of 16, and pointers to views whose offsets vary (rows of a step's shared buffers, slices of the
#: engine's tensors), whose 16-byte alignment it would specialize on. What an engine keeps constant (the caches'
#: strides and base, head counts and widths, the policy's settings) stays specialized, and the units' rows are padded
#: to a multiple of 16 (:data:`UNIT_ROWS`), so the greedy kernel's Gram rows stay aligned.
#: ``tests/compress/test_kernel_variants.py`` computes Triton's own specialization of every launch over compressions
#: of many sizes: one variant per kernel and width (the widths a server takes are compiled at start-up:
#: :mod:`cords_vllm.compress.kernel_warmup`).
NOT_SPECIALIZED = {
    "plan": (("hs_a", "hs_h", "n_spans", "n_prev", "n_tok", "num_recent", "need", "group"),
             ("held_ids", "held_video", "held_labels", "new_ids", "new_labels", "spans", "region_ids",
              "region_video", "region_labels", "elig_rank", "unit_of", "row_of_rank", "unit_start", "unit_size",
              "protect", "count_out", "still_out", "stats", "flag")),
    "units": (("n_tok", "frame_budget", "k_fixed", "n_problems"),
              ("src_slots", "row_of_rank", "unit_start", "unit_size", "count_in", "kn_out", "vn_out", "seed_out",
               "valid_out", "k_out", "flag", "stats")),
    "finish": (("n_tok", "m_units", "k_max", "k_stride", "num_keep"),
               ("order", "k_in", "still_in", "count_in", "elig_rank", "unit_of", "unit_start", "unit_size", "protect",
                "region_ids", "region_video", "region_labels", "kept_count", "positions", "out_ids", "out_video",
                "out_labels", "flag", "nonfinite", "runs_out")),
    "normalize": (("f_problem", "n_field", "n_problem", "v_problem"), ("feats", "norms", "valid")),
}


@functools.cache
def compiled(interpret: bool, kernel: str = "plan"):
    """Each kernel, jitted on first use (under the interpreter when ``TRITON_INTERPRET=1`` at that time), with the
    arguments of :data:`NOT_SPECIALIZED` left unspecialized."""
    sizes, pointers = NOT_SPECIALIZED[kernel]
    return triton.jit({"plan": _plan_kernel, "units": _units_kernel, "finish": _finish_kernel,
                       "normalize": _normalize_kernel}[kernel],
                      do_not_specialize=sizes, do_not_specialize_on_alignment=pointers)


if triton is not None:  # the units kernel's helpers: jitted (compiled or interpreted alike) when Triton imports
    _e4m3 = triton.jit(_e4m3)
    _e5m2 = triton.jit(_e5m2)
    _unit_tile = triton.jit(_unit_tile)


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


@dataclass(eq=False)
class _UnitRows:
    """Where a compression's units go: ``feats`` ``float32 [P, M, 2W]``, ``norms`` ``float32 [3, P, M]`` (key, value
    and seed norms), ``valid`` ``int8 [P, M]``, ``k`` ``long [P]``; rows ``[start, stop)`` of ``stack``'s when a step's
    compressions share them (``M`` then the step's largest unit count), else the compression's own (``stack`` is
    ``None``); ``M`` a multiple of :data:`UNIT_ROWS`, the units past a problem's own count invalid."""

    feats: torch.Tensor
    norms: torch.Tensor
    valid: torch.Tensor
    k: torch.Tensor
    stack: _UnitRows | None = None
    start: int = 0
    stop: int = 0


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
class UnitRowsToMake:
    """A fused compression's units' buffers (:class:`~cords_vllm.selection.together.Stackable`): its own, or, for a
    step's compressions together, rows of buffers they share, zero-filled (one launch) so that each problem's units
    past its own count are invalid, and ordered by one greedy launch (:class:`GreedyOnRows`)."""

    device: torch.device
    problems: int
    units: int
    width: int

    def stack_key(self) -> tuple:
        return self.device, self.width

    def run(self) -> _UnitRows:
        p, m, w = self.problems, self.units, self.width
        norms = torch.empty((3, p, m), dtype=torch.float32, device=self.device)
        return _UnitRows(torch.empty((p, m, 2 * w), dtype=torch.float32, device=self.device), norms,
                         torch.empty((p, m), dtype=torch.int8, device=self.device),
                         torch.empty((p,), dtype=torch.long, device=self.device))

    @classmethod
    def run_stack(cls, items: Sequence[UnitRowsToMake]) -> list[_UnitRows]:
        first = items[0]
        p, m, w = sum(i.problems for i in items), max(i.units for i in items), first.width
        n_feats, n_norms = p * m * 2 * w, 3 * p * m
        raw = torch.zeros(8 * p + 4 * (n_feats + n_norms) + p * m, dtype=torch.uint8, device=first.device)
        floats = raw[8 * p: 8 * p + 4 * (n_feats + n_norms)].view(torch.float32)
        stack = _UnitRows(floats[:n_feats].view(p, m, 2 * w), floats[n_feats:].view(3, p, m),
                          raw[8 * p + 4 * (n_feats + n_norms):].view(torch.int8).view(p, m),
                          raw[: 8 * p].view(torch.long))
        out, start = [], 0
        for item in items:
            stop = start + item.problems
            out.append(_UnitRows(stack.feats[start:stop], stack.norms[:, start:stop], stack.valid[start:stop],
                                 stack.k[start:stop], stack, start, stop))
            start = stop
        return out


@dataclass(frozen=True)
class GreedyOnRows:
    """The greedy run of a fused compression's units (:class:`~cords_vllm.selection.together.Stackable`): the Gram
    GEMMs and the greedy kernel on its rows, or once on the rows a step's compressions share. Returns
    ``long [P, K]`` (``K >= k_max``, at least 1 column)."""

    rows: _UnitRows
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


def _greedy(rows: _UnitRows, width: int, k_max: int, params: GreedyParams) -> torch.Tensor:
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


def gathered_rows(local: _UnitRows, gather, heads: int, head_size: int, interp: bool, norms: bool = True
                   ) -> SelectionSteps[tuple[_UnitRows, int]]:
    """This rank's units (``local``: its ``heads`` KV heads) with every rank's heads, in the rows the greedy run reads:
    one all-gather of the units' features (``float32 [P, M, 2 * heads * head_size]``, keys then values, in the
    model's head order, as :mod:`~cords_vllm.compress.tensor_parallel` lays them out), their validity and budgets
    copied, their norms made again over all heads (:func:`_normalize_kernel` without the scaling; not with ``norms``
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
    """:func:`_normalize_kernel` on ``P`` problems' rows (``feats`` ``[P, M', 2 * width]``, ``norms`` ``[3, P, M']``,
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
    _, heads, block_size, channels = first.shape
    head_size = channels // 2
    n_anchor = len(anchors)
    per_head = setup.per_head
    hp = heads if per_head else 1
    n_prob = n_anchor * hp
    unit = batch.unit(setup)
    labels_given = batch.new_labels is not None
    group = batch.group_size
    need, n_cand = batch.num_keep_candidates, batch.num_candidates
    if not 0 <= need < n_cand:
        raise ValueError(f"need: must be in [0, {n_cand}) (the candidate count), got {need}")
    width = heads * head_size if not per_head else head_size
    n_prev = 0 if held[anchors[0]] is None else held[anchors[0]].ids.shape[1]
    n_tok = n_prev + batch.new_ids.shape[0]
    if n_tok > MAX_ROWS:
        return _handed_back(f"a region of more than {MAX_ROWS} rows")
    empty_long = torch.empty(1, dtype=torch.long, device=device)
    if n_prev:
        h_ids, h_video, h_labels = _stacked(held, anchors)
        hs_a, hs_h = h_ids.stride(0), h_ids.stride(1)
        if h_video.stride()[:2] != (hs_a, hs_h) or (h_labels is not None and h_labels.stride()[:2] != (hs_a, hs_h)):
            h_ids, h_video = h_ids.contiguous(), h_video.contiguous()
            h_labels = None if h_labels is None else h_labels.contiguous()
            hs_a, hs_h = h_ids.stride(0), h_ids.stride(1)
        if h_ids.shape[1] == 1:
            hs_h = 0
    else:  # a first compression: no held tokens, in the types of held ones (one variant for both)
        h_ids, h_video, h_labels, hs_a, hs_h = empty_long, empty_long.view(torch.bool)[:1], None, 0, 0
    labels = labels_given and (n_prev == 0 or h_labels is not None)  # the region's labels, as the reference's
    if unit == "frame" and labels:
        if group is None:
            raise ValueError("group_size: required (the largest frame, in tokens) at frame granularity")
        mode = FRAME
    elif unit == "token" or group is None or cdiv(need, group) > n_cand // group:
        mode = TOKEN
    else:
        mode = BLOCK
    if mode != FRAME and (n_cand if mode == TOKEN else n_cand // group) > MAX_UNITS:
        return _handed_back(f"more than {MAX_UNITS} units")

    def buf(dtype: torch.dtype, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    block_t = max(16, triton.next_power_of_2(n_tok))
    region_ids, region_video = buf(torch.long, n_prob, n_tok), buf(torch.bool, n_prob, n_tok)
    region_labels = buf(torch.long, n_prob, n_tok) if labels else empty_long
    elig_rank, unit_of, row_of_rank = (buf(torch.int32, n_prob, n_tok) for _ in range(3))
    unit_start, unit_size, kept_count = (buf(torch.int32, n_prob, n_tok) for _ in range(3))
    protect = buf(torch.bool, n_prob, n_tok)
    count, still = buf(torch.int32, n_prob), buf(torch.int32, n_prob)
    stats, flag = buf(torch.int32, n_prob, 2), buf(torch.int32, 1)
    interp = interpreting()
    spans = batch.spans.contiguous()
    launch("plan", compiled(interp, "plan"), (n_prob,),
        h_ids, h_video, h_labels if h_labels is not None else empty_long, hs_a, hs_h,
        batch.new_ids.contiguous(), batch.new_labels.contiguous() if labels_given else empty_long,
        spans, spans.shape[0], region_ids, region_video, region_labels, elig_rank, unit_of, row_of_rank,
        unit_start, unit_size, protect, count, still, stats, flag,
        n_prev, n_tok, hp, batch.num_recent, need, group or 1,
        MODE=mode, LABELS=labels, **row_width(block_t))

    # What needs nothing the plan computes is worked out while it runs, before the frame mode's read waits for it.
    params = setup.selector.greedy_params()
    gather = None if per_head else setup.gather_heads
    scan = nonfinite is not None
    s_block, s_head, s_offset, s_channel = first.stride()
    starts = tuple(caches[a].data_ptr() - first.data_ptr() for a in anchors)  # bytes
    offsets = copy_triton.device_table(tuple(s // first.element_size() for s in starts), device)  # made once
    block_f = max(16, triton.next_power_of_2(width))
    tile_rows = max(1, TILE_ELEMENTS // block_f)
    scan_programs = cdiv(n_tok, tile_rows) if scan else 0
    fp8 = _fp8_mode(codecs, anchors)
    scales = _scales(codecs, anchors, heads, device) if fp8 else empty_long

    bound = _frames_bound(held, anchors, batch, n_prev, n_cand) if mode == FRAME else None
    read = mode == FRAME and bound is None
    per_problem = yield StatsToRead(device, stats if read else None)  # with the step's other reads
    frame_budget = 0
    if mode == FRAME and not read:  # sized by the host's bound; the units kernel reads the budget from the plan
        m_units = bound
        frame_budget = -1 if batch.frame_budget is None else batch.frame_budget
        k_max = m_units if batch.frame_budget is None else min(batch.frame_budget, m_units)
    elif mode == FRAME:  # the compression's one host read: the most frames of a problem, and the frame budget
        m_units = max(c for c, _ in per_problem)
        frame_budget = batch.frame_budget if batch.frame_budget is not None else max(b for _, b in per_problem)
        k_max = frame_budget * (m_units > frame_budget)
    elif mode == BLOCK:
        m_units = n_cand // group
        k_max = cdiv(need, group) * (n_cand > cdiv(need, group) * group)
    else:
        m_units, k_max = n_cand, need  # need < n_cand: never a covering budget
    if m_units > MAX_UNITS or n_prob * m_units * m_units * 8 > GRAM_LIMIT_BYTES:
        return _handed_back(f"more than {MAX_UNITS} units or {GRAM_LIMIT_BYTES >> 30} GiB of Gram matrices")

    unit_rows = cdiv(max(m_units, 1), UNIT_ROWS) * UNIT_ROWS  # the units' rows, padded with invalid units
    to_make = UnitRowsToMake(device, n_prob, unit_rows, width)
    # Under tensor parallelism (joint selection) this rank's units are made alone, then gathered with the other
    # ranks' heads into the rows the greedy run reads; otherwise made in those rows.
    rows = (yield to_make) if gather is None else to_make.run()
    feats, valid, k = rows.feats, rows.valid, rows.k
    kn, vn, seed = rows.norms.unbind(0)
    launch("units", compiled(interp, "units"), (n_prob, unit_rows + scan_programs),
        first, offsets, scales, batch.src_slots.contiguous(), row_of_rank, unit_start, unit_size, count,
        feats, kn, vn, seed, valid, k, flag, stats, n_prob,
        n_tok, unit_rows, feats.shape[1], hp, heads, head_size, frame_budget, k_max,
        s_block, s_head, s_offset, s_channel,
        MODE=mode, PER_HEAD=per_head, SCAN=scan, FP8=fp8, BLOCK_SIZE=block_size,
        ALIGN=copy_triton.alignment(first, starts, head_size),
        BLOCK_F=block_f, TILE_T=tile_rows)
    if gather is not None:
        rows, width = yield from gathered_rows(rows, gather, heads, head_size, interp,
                                                norms=params.space != "normalized")
        k = rows.k

    order = yield GreedyOnRows(rows, width, k_max, params)
    num_keep = batch.num_keep
    shape = (n_anchor, hp, num_keep)  # the held tokens' views below keep this root
    positions = buf(torch.long, *shape)
    out_ids, out_video = buf(torch.long, *shape), buf(torch.bool, *shape)
    out_labels = buf(torch.long, *shape) if labels else empty_long
    runs = buf(torch.int32, n_prob) if labels else empty_long
    launch("finish", compiled(interp, "finish"), (n_prob,),
        order, k, still, count, elig_rank, unit_of, unit_start, unit_size, protect,
        region_ids, region_video, region_labels, kept_count, positions, out_ids, out_video, out_labels,
        flag, nonfinite if scan else empty_long, runs,
        n_tok, max(m_units, 1), k_max, order.stride(0), num_keep,
        LABELS=labels, SCAN=scan, **row_width(block_t))

    positions = positions.expand(n_anchor, heads, num_keep)
    row_of = {a: i for i, a in enumerate(anchors)}
    anchor_row = [row_of[setup.anchor_of[layer]] for layer in range(len(caches))]
    copy_triton.copy_kept(caches, positions, anchor_row, batch.src_slots, batch.dst_slots)
    out_labels = out_labels if labels else None
    label_runs = LateRead.of(runs) if labels else None  # for the next compression's bound, on its way to the host
    kept = [HeldTokens(out_ids[i].expand(heads, -1), out_video[i].expand(heads, -1),
                       None if out_labels is None else out_labels[i].expand(heads, -1), label_runs)
            for i in range(n_anchor)]
    return [kept[row] for row in anchor_row]
