"""The fused compress step's Triton kernels (the host driver is :mod:`cords_vllm.compress.step_triton`, which
documents the step they make up):

* :func:`_plan_kernel`: a problem's region tokens, the recent window's protection and the units the policy ranks;
* :func:`_units_kernel`: each unit's mean key and value from the paged cache, and their norms;
* :func:`_finish_kernel`: the exact-count rule, kept positions in row order, the tokens the region now holds;
* :func:`_normalize_kernel`: the normalized space's scaling of every problem's units.

Each is declared ``@kernel`` (:mod:`cords_vllm.selection.triton_jit`: jitted on first use, under the interpreter when
``TRITON_INTERPRET=1`` at that time, with the arguments that change between compressions unspecialized,
:data:`NOT_SPECIALIZED`), and :func:`compiled` gives them jitted; their helpers are declared ``@device_function``
(``@triton.jit``: Triton inlines them where they are called). The kernel names are what a profiler shows
(``benchmarks/compress_step.py`` maps them).
"""

from __future__ import annotations

from cords_vllm.selection.triton_jit import device_function, jitted, kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

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


@kernel(*NOT_SPECIALIZED["plan"])
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
    video, labels = _region_tokens(held_ids, held_video, held_labels, hs_a, hs_h, new_ids, new_labels, spans,
                                   n_spans, region_ids, region_video, region_labels, p, a, h, t, inside, n_prev,
                                   n_tok, LABELS, BLOCK_T)
    row = p * n_tok
    sel, elig, still, kept_whole = _eligible(video, labels, num_recent, need, group, MODE, BLOCK_T)
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
    else:
        unit, count = _frame_units(row_of_rank, region_labels, unit_start, unit_size, stats, p, row, elig, rank,
                                   n_elig, labels, still, BLOCK_T)
    tl.store(unit_of + row + t, unit, mask=inside)
    tl.store(count_out + p, count)
    tl.store(still_out + p, still)


@device_function
def _region_tokens(held_ids, held_video, held_labels, hs_a, hs_h, new_ids, new_labels, spans, n_spans,
                   region_ids, region_video, region_labels, p, a, h, t, inside, n_prev, n_tok,
                   LABELS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Problem ``p``'s region (anchor ``a``, head ``h``): its rows ``t`` (``[BLOCK_T]``, ``inside`` the ``n_tok``
    of them) are the ``n_prev`` tokens it held (``held_*[a, h]``, strides ``hs_a`` and ``hs_h``), then the entering
    ones (``new_*``; video where their ids fall in one of the ``n_spans`` ``[lo, hi)`` pairs of ``spans``), written to
    its rows of ``region_*`` (``[P, T]``). Returns the rows' video flags and labels (``[BLOCK_T]``; labels 0 without
    ``LABELS``)."""
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
    return video, labels


@device_function
def _eligible(video, labels, num_recent, need, group, MODE: tl.constexpr, BLOCK_T: tl.constexpr):
    """The recent window: the newest ``num_recent`` video tokens are protected this time. Of a region's rows
    (``video``, ``labels``: ``[BLOCK_T]``) returns those outside the window (``sel``), those of them the units hold
    (``elig``), the candidates kept whole (``kept_whole``: at frame granularity, ``MODE`` 2, the newest frame when the
    region's edge cut it short), each ``[BLOCK_T]``, and the tokens the units must still keep (``still``: ``need``
    less those)."""
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
    return sel, elig, still, kept_whole


@device_function
def _frame_units(row_of_rank, region_labels, unit_start, unit_size, stats, p, row, elig, rank, n_elig, labels,
                 still, BLOCK_T: tl.constexpr):
    """Labelled frames as units (``MODE`` 2): a frame starts where an eligible token's label differs from the
    previous eligible token's. Of the region's rows (``[BLOCK_T]``: ``elig``, their ``rank`` among the eligible
    ones, ``labels``) writes the frames' first ranks and sizes (rows ``row`` of ``unit_start`` and ``unit_size``,
    ``[P, T]``) and ``stats[p]``: the frame count and the fewest frames any choice of which holds ``still`` tokens.
    Returns each row's frame (``[BLOCK_T]``, -1 for none) and the frame count."""
    t = tl.arange(0, BLOCK_T)
    u = t  # unit slots, as wide as the rows
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
    holding = _frames_holding(tl.where(u < count, size, 0), count, still)
    tl.store(stats + 2 * p, count)
    tl.store(stats + 2 * p + 1, holding)
    return unit, count


@device_function
def _frames_holding(sizes, count, still):
    """The fewest of ``count`` frames (``sizes``: ``[BLOCK_T]``, 0 past them) any choice of which holds ``still``
    tokens: as many of the smallest frames as reach it (at least 1, at most ``count``). Without a sort (whose network
    takes a minute to compile at a 7B region's width): the smallest size v whose frames up to that size hold
    ``still`` (a bisection), the frames below it, and of size v what is left."""
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
    return tl.minimum(tl.where(still <= 0, 1, holding), count)


@device_function
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


@device_function
def _e5m2(b):
    """fp32 values of e5m2 bytes (``uint8``), exactly: an e5m2 byte is the high byte of the fp16 with its value."""
    return (b.to(tl.int16) << 8).to(tl.float16, bitcast=True).to(tl.float32)


@kernel(*NOT_SPECIALIZED["units"])
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
        acc_k, acc_v = _unit_sums(cache, src_slots, row_of_rank, p * n_tok, start, size, at, v_at, in_f, k_scale,
                                  v_scale, s_block, s_offset, FP8, BLOCK_SIZE, BLOCK_F, TILE_T, ALIGN)
        _store_unit(feats, kn_out, vn_out, seed_out, valid_out, acc_k, acc_v, size, ok, p, u, m_stride, f, in_f,
                    width)
    if SCAN:  # noqa: SIM102 (Triton: a constexpr branch around a runtime one)
        if u >= m_units:
            _scan_rows(cache, src_slots, flag, (u - m_units) * TILE_T, n_tok, at, v_at, in_f, k_scale, v_scale,
                       s_block, s_offset, FP8, BLOCK_SIZE, TILE_T, ALIGN)


@device_function
def _decoded(x, y, k_scale, v_scale, FP8: tl.constexpr):
    """Keys ``x`` and values ``y`` as read from the cache (tiles of ``[TILE_T, BLOCK_F]``) in fp32: converted, or
    fp8 bytes (``FP8`` 1: e4m3, 2: e5m2) decoded and scaled (``k_scale``, ``v_scale``: ``[BLOCK_F]``)."""
    if FP8 == 0:
        x, y = x.to(tl.float32), y.to(tl.float32)
    elif FP8 == 1:
        x, y = _e4m3(x) * k_scale[None, :], _e4m3(y) * v_scale[None, :]
    else:
        x, y = _e5m2(x) * k_scale[None, :], _e5m2(y) * v_scale[None, :]
    return x, y


@device_function
def _unit_sums(cache, src_slots, row_of_rank, row, start, size, at, v_at, in_f, k_scale, v_scale, s_block, s_offset,
               FP8: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_F: tl.constexpr, TILE_T: tl.constexpr,
               ALIGN: tl.constexpr):
    """The sums of a unit's ``size`` tokens' keys and values (``float32 [BLOCK_F]`` each; the tokens' region rows at
    ``row_of_rank[row + start ...]``, their slots in ``src_slots``, their channels at offsets ``at`` and ``v_at`` of
    ``cache``, those past ``in_f`` 0), non-finite entries read as 0, ``TILE_T`` tokens at a time.

    A token's address is three dependent loads (its row, its slot, its channels). The tiles are pipelined so that an
    iteration's loads are independent of each other: the channels of tile t, the slots of tile t + 1 (from rows read
    the iteration before) and the rows of tile t + 2, so a tile waits on one load, not three. The sums are the same,
    in the same order."""
    acc_k = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_F], dtype=tl.float32)
    lane = tl.arange(0, TILE_T)
    ranks = row_of_rank + row + start
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
        elif FP8 == 1:  # e4m3fn: NaN is S.1111.111
            x_ok, y_ok = mask & ((x & 0x7F) != 0x7F), mask & ((y & 0x7F) != 0x7F)
        else:  # e5m2: inf and NaN are S.11111.xx
            x_ok, y_ok = mask & ((x & 0x7C) != 0x7C), mask & ((y & 0x7C) != 0x7C)
        x, y = _decoded(x, y, k_scale, v_scale, FP8)
        slot = tl.load(src_slots + rows, mask=j0 + TILE_T + lane < size, other=0)
        rows = tl.load(ranks + 2 * TILE_T + j0 + lane, mask=j0 + 2 * TILE_T + lane < size, other=0)
        acc_k += tl.sum(tl.where(x_ok & (x == x) & (tl.abs(x) < float("inf")), x, 0.0), 0)
        acc_v += tl.sum(tl.where(y_ok & (y == y) & (tl.abs(y) < float("inf")), y, 0.0), 0)
    return acc_k, acc_v


@device_function
def _store_unit(feats, kn_out, vn_out, seed_out, valid_out, acc_k, acc_v, size, ok, p, u, m_stride, f, in_f, width):
    """Unit ``u`` of problem ``p`` (whether it is one: ``ok``): its mean key and value (``acc_k``, ``acc_v``: sums
    over its ``size`` tokens, ``[BLOCK_F]``, channels ``f`` of which ``in_f`` are read) to ``feats[p, u]`` (rows of
    ``2 * width``), their norms and the seed score (``||key + value||``) to ``*_out[p, u]`` (rows of ``m_stride``)."""
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


@device_function
def _scan_rows(cache, src_slots, flag, first_row, n_tok, at, v_at, in_f, k_scale, v_scale, s_block, s_offset,
               FP8: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_T: tl.constexpr, ALIGN: tl.constexpr):
    """Sets ``flag`` where rows ``first_row ... first_row + TILE_T`` of the region (of ``n_tok``; their slots in
    ``src_slots``) hold a non-finite key or value entry (channels ``at``, ``v_at`` of ``[BLOCK_F]``, ``in_f`` read;
    an fp8 NaN or inf byte told from its bits)."""
    rows = first_row + tl.arange(0, TILE_T)
    live = rows < n_tok
    slot = tl.load(src_slots + rows, mask=live, other=0)
    token = tl.multiple_of((slot // BLOCK_SIZE) * s_block + (slot % BLOCK_SIZE) * s_offset, ALIGN)[:, None]
    mask = live[:, None] & in_f[None, :]
    x = tl.load(cache + token + at[None, :], mask=mask, other=0)
    y = tl.load(cache + token + v_at[None, :], mask=mask, other=0)
    if FP8 == 0:
        x_bad, y_bad = x != x, y != y
    elif FP8 == 1:
        x_bad, y_bad = (x & 0x7F) == 0x7F, (y & 0x7F) == 0x7F
    else:
        x_bad, y_bad = (x & 0x7C) == 0x7C, (y & 0x7C) == 0x7C
    x, y = _decoded(x, y, k_scale, v_scale, FP8)
    bad = tl.sum(tl.sum((x_bad | y_bad | (x != x) | (tl.abs(x) == float("inf")) | (y != y)
                         | (tl.abs(y) == float("inf"))).to(tl.int32), 1), 0)
    if bad > 0:
        tl.store(flag, 1)


@kernel(*NOT_SPECIALIZED["finish"])
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


@device_function
def _unit_tile(valid, p, v_problem, m0, m_units, width, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Units ``[m0, m0 + BLOCK_S)`` of problem ``p``, as a tile of one component: the units (``[BLOCK_S]``), which
    are valid, the elements' offsets from the problem's first unit (``[BLOCK_S, BLOCK_W]``, rows of ``2 * width``)
    and the mask of the valid units' channels."""
    m = m0 + tl.arange(0, BLOCK_S)
    w = tl.arange(0, BLOCK_W)
    ok = (m < m_units) & (tl.load(valid + p * v_problem + m, mask=m < m_units, other=0) != 0)
    return m, ok, m[:, None].to(tl.int64) * (2 * width) + w[None, :], ok[:, None] & (w < width)[None, :]


@kernel(*NOT_SPECIALIZED["normalize"])
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


#: The kernels by the names :func:`compiled` takes (the launches' names in :mod:`cords_vllm.kernel_backend`).
KERNELS = {"plan": _plan_kernel, "units": _units_kernel, "finish": _finish_kernel, "normalize": _normalize_kernel}


def compiled(interpret: bool, kernel: str = "plan"):
    """The kernel named ``kernel`` (of :data:`KERNELS`), jitted on first use (under the interpreter when
    ``TRITON_INTERPRET=1`` at that time), with the arguments of :data:`NOT_SPECIALIZED` left unspecialized."""
    return jitted(KERNELS[kernel], interpret)
