"""CoRDS's greedy run as one Triton kernel: every greedy step of every problem in a single launch.

The kernel beside its reference, :func:`~cords_vllm.selection.cords.cords_greedy` (the PyTorch path, which stays
the CPU path and the reference this one is tested against). It covers every variant of the run: the max-cosine
novelty (the default), the exact novelty (an ablation) and the plain D^2 step (``lam = 0``: k_only, v_only, CoRDS
without a bonus).

Design (one GEMM, then a persistent greedy loop over rows):

1. The Gram matrices ``G_K = K K^T`` and ``G_V = V V^T`` of each problem's units (``[P, M, M]``, fp32 IEEE, one
   batched GEMM each, only those the score reads), and the unit norms and seed scores, computed by the same
   PyTorch ops as the reference.
2. :func:`_greedy_kernel`: one program per problem holds its whole state on chip, ``M`` units wide: the running
   minimum distance ``d_alpha(i, S)``, which also marks the pool (``-inf`` out of it), the running minimum
   ``1 - cos`` of keys and values, the norms. A greedy step reads two rows of the Gram matrices (``G[j, :]`` of the
   unit ``j`` chosen last, the only memory traffic of a step), folds the new point into the state, min-max
   normalises over the pool and picks the next unit with the reference's tie rule (the lowest index within ``tol``
   of the best score). All ``k_max`` steps run inside the program: no launch, no host read between steps.
   A step takes at least the cycles one SM needs to issue its instructions for ``M`` units (at token units, most of
   it), plus the latency of its program-wide reductions (at block units, most of it). So the state carries no
   separate pool mask (out of the pool every term is ``-inf``, and ``min |x|`` is the pool's minimum of a term that
   is ``>= 0`` in it); each term's normalisation is one multiply by a per-step scale; the reductions take the
   maximum of the terms' bits as integers (:func:`_range_keys`: one ``REDUX`` per warp and value, not a chain of five
   shuffles); and the chosen unit's own terms (its reciprocal norms and squared-norm sum) are read from a scratch row
   the program wrote once, not divided out again by every thread. And a step's work follows the pool, not the row:
   once the pool fits in half the row (``COMPACT``, from :data:`COMPACT_FROM` units), its units' indices, state and
   terms are packed in index order into half as wide a state, and the steps go on over those (the Gram rows read at
   the packed indices; the tie rule's order is theirs). At 7,744 units on sm_90: 492 instructions a step over the
   whole row (577 with float reductions, 672 with a boolean pool besides), 314 over the packed pool, which the last
   2,560 of a 6,144-step run take; 151 at 480 units (235) (:func:`tests.support.cuda_compile.loop_instructions`).
3. The exact novelty (:func:`_exact_residual`) keeps the squared residuals ``||(I - P_S) x_i||^2`` on chip instead
   of the running cosines, and the orthonormal directions of the selected set in a global buffer (at most ``Dc``
   per component, ``[P, C, Dc, Dc]`` for the ``C`` components it reads). A step whose new unit still has a residual
   orthogonalises its features against the directions so far (``O(n Dc)``) and projects every unit on the new
   direction (one pass over the units' features, ``O(M Dc)``, whole units at a time, the reference's matvec); a step
   whose new unit has none (every step once the directions span the space, after at most ``Dc`` of them) costs what
   a D^2 step costs. No host read: the reference reads its saturation flag back once per step until it saturates.

The arithmetic is the reference's, term for term (:mod:`cords_vllm.selection.cords`'s "Numerics"): the same
snapping of distances to 0 and of cosines to 1, the same normalisation and the same tie slack. Dot products come
from the Gram matrix instead of the reference's per-step matvec, so scores differ in their last bits; the tie
slack, which exists for exactly this, makes the chosen units the same (tested on the shared selector matrix under
``TRITON_INTERPRET=1``).

Launches per call: the norms, the seed scores, one or two GEMMs and the kernel: a fixed number whatever ``M``
and ``k_max``. Memory: ``M`` x ``M`` fp32 per Gram matrix and problem (and ``10 M`` words of scratch); problems past
:data:`GRAM_LIMIT_BYTES` or :data:`MAX_UNITS` (what one program holds on chip) run on the PyTorch path (said once in
the log).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cords_vllm.kernel_backend import interpreting, launch
from cords_vllm.selection.greedy_params import GreedyParams, snap_tolerance
from cords_vllm.selection.triton_jit import device_function, jitted, kernel

logger = logging.getLogger(__name__)

#: The most units one problem may have on the kernel path: a program holds a problem's whole state in registers.
MAX_UNITS = 16384
#: The most bytes the Gram matrices of one call may take on the kernel path.
GRAM_LIMIT_BYTES = 4 << 30
#: The narrowest run whose steps go on over the pool alone once it fits in half the run's width (narrower runs wait
#: on their reductions, not on the work per unit, and compile one loop instead of two).
COMPACT_FROM = 2048
#: Every run's units are padded with invalid ones to a multiple of this: the kernel specializes on the unit count
#: (the Gram rows' alignment), so runs of any size share its one variant per width (:func:`unit_width`).
UNIT_ROWS = 16

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are only built when kernel_backend says Triton runs
    triton = tl = None

#: The greedy kernel's arguments Triton must not specialize, so that another budget compiles nothing: the step count
#: and the directions' cap (integers that change from one run to the next, which Triton would otherwise compile a
#: variant for at the value 1 and at multiples of 16), and the per-unit vectors and scratch that may be views at
#: varying offsets (rows of a step's shared buffers; alignment). The unit count and the Gram matrices' strides stay
#: specialized: the fused step pads the units to a multiple of 16, so every Gram row it reads is 16-byte aligned.
NOT_SPECIALIZED = (("k_max", "b_rows"), ("kn_ptr", "vn_ptr", "seed_ptr", "valid_ptr", "k_ptr", "out_ptr", "proj_ptr"))


@device_function
def _exact_residual(res, thr, n_dirs, j, offs, inside, m_units, feats_ptr, f_row, f_unit, comp_off, comp_dim,
                    basis_ptr, b_base, b_rows, proj_ptr, p_row, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One component's (keys' or values') exact novelty after unit ``j`` joins the selected set: the squared
    residuals ``res`` (``[BLOCK]``, snapped to 0 below ``thr``) lose their projection on ``j``'s new direction.

    As the reference's :func:`~cords_vllm.selection.cords_torch._new_direction` and residual update, op for op:
    ``j`` adds a direction only while its own residual is positive; the direction is ``x_j`` orthogonalised against
    the ``n_dirs`` directions so far (classical Gram-Schmidt, twice) and normalised; every unit's residual loses the
    square of its projection on it, is clamped at 0 and snapped to 0 at ``thr``. The directions are rows of
    ``basis[b_base:]`` (``comp_dim`` wide, at most ``b_rows`` of them: a span of ``comp_dim`` dimensions holds no
    more). The reference keeps a zero row where no direction is added; here none is kept, which changes no sum but
    their order. The projections are computed ``BLOCK_S`` whole units at a time (each unit's channels read
    contiguously) into ``proj[p_row:]``, then read back as one vector. Returns ``(res, n_dirs)``."""
    res_j = tl.sum(tl.where(offs == j, res, 0.0), 0)
    if (res_j > 0.0) & (n_dirs < b_rows):
        d = tl.arange(0, BLOCK_D)
        in_d = d < comp_dim
        u = tl.load(feats_ptr + f_row + j.to(tl.int64) * f_unit + comp_off + d, mask=in_d, other=0.0)
        for _ in tl.static_range(2):  # classical Gram-Schmidt with one re-orthogonalisation pass
            delta = tl.zeros([BLOCK_D], dtype=tl.float32)
            for s0 in range(0, n_dirs, BLOCK_S):
                s = s0 + tl.arange(0, BLOCK_S)
                q = tl.load(basis_ptr + b_base + s[:, None] * comp_dim + d[None, :],
                            mask=(s < n_dirs)[:, None] & in_d[None, :], other=0.0)
                coef = tl.sum(q * u[None, :], 1)
                delta += tl.sum(coef[:, None] * q, 0)
            u = u - delta
        norm = tl.sqrt(tl.sum(u * u, 0))
        if norm > 0.0:
            q = u / norm
            tl.store(basis_ptr + b_base + n_dirs.to(tl.int64) * comp_dim + d, q, mask=in_d)
            for m0 in range(0, m_units, BLOCK_S):
                m = m0 + tl.arange(0, BLOCK_S)
                x = tl.load(feats_ptr + f_row + m[:, None].to(tl.int64) * f_unit + comp_off + d[None, :],
                            mask=(m < m_units)[:, None] & in_d[None, :], other=0.0)
                tl.store(proj_ptr + p_row + m, tl.sum(x * q[None, :], 1), mask=m < m_units)
            tl.debug_barrier()  # every unit's projection, written by other threads, is read back as one vector
            proj = tl.load(proj_ptr + p_row + offs, mask=inside, other=0.0)
            tl.debug_barrier()  # read before the next direction's projections overwrite it
            res = tl.maximum(res - proj * proj, 0.0)
            res = tl.where(res <= thr, 0.0, res)
            n_dirs += 1
    return res, n_dirs


@device_function
def _range_keys(x):
    """Integer keys of a state row ``x`` (``float32 [BLOCK]``: ``>= +0`` in the pool, ``-inf`` out of it) whose
    maximum, one reduction, gives the pool's range (:func:`_range_of`): ``[BLOCK, 2]``, the bits of ``x`` and those of
    ``|x|`` inverted. A float ``>= +0`` orders as its bits do as an ``int32`` and ``-inf``'s are negative, so the
    bits' maximum is ``max x``; inverting the low 31 bits of ``|x|``'s reverses their order, so their maximum is
    ``min |x|``'s (``+inf``'s where the pool is empty). A warp reduces an ``int32`` in one instruction (sm_80 and
    later) where a float takes five shuffles and five comparisons, each waiting on the one before."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.join(bits, ~bits & 0x7FFFFFFF)


@device_function
def _range_of(keys):
    """``(max x, -min |x|)`` (``float32`` scalars) from the maximum of :func:`_range_keys` (``int32 [2]``)."""
    hi, lo = tl.split(keys)
    return hi.to(tl.float32, bitcast=True), -((~lo & 0x7FFFFFFF).to(tl.float32, bitcast=True))


@kernel(*NOT_SPECIALIZED)
def _greedy_kernel(gk_ptr, gv_ptr, kn_ptr, vn_ptr, seed_ptr, valid_ptr, k_ptr, out_ptr, state_ptr, ids_ptr,
                   feats_ptr, basis_ptr, proj_ptr, m_units, k_max, gram_stride, f_problem, f_unit, comp_dim, value_off,
                   b_rows, alpha, one_minus_alpha, neg2a, neg2b, eta, one_minus_eta, lam, eps0, tol, neg_snap,
                   USE_KD: tl.constexpr, USE_VD: tl.constexpr, USE_KO: tl.constexpr, USE_VO: tl.constexpr,
                   EXACT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                   COMPACT: tl.constexpr):
    """One problem's whole greedy run (program ``p``); writes ``out[p, :k_max]`` (``-1`` after ``k[p]``).

    ``state[p]``: the program's scratch, ``float32 [9, m_units]``: every unit's squared-norm sum ``base`` and its
    reciprocal key and value norms, written once and read back by each step (the chosen unit's, written by another
    thread, rather than every thread working them out from its norms again, a division each: some 25 instructions a
    step for every warp; and every unit's rather than holding them in registers, which spilled); where the run
    compacts its pool (``COMPACT``), the same three of the pool's units and their running state (distance, key and
    value novelty), packed, and their indices in ``ids[p]`` (``int32 [m_units]``).

    ``EXACT``: the novelty is the exact residual (:func:`_exact_residual`, reading the units' features
    ``feats[p]``, ``f_unit`` apart, keys at 0 and values at ``value_off``, each ``comp_dim`` wide; the directions in
    ``basis[p]``, ``[C, b_rows, comp_dim]`` for the ``C`` components the novelty reads, keys first; the projections
    in ``proj[p]``, ``[m_units]``), else the max-cosine surrogate (from the Gram rows)."""
    p = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < m_units
    vec = p * m_units
    valid = (tl.load(valid_ptr + vec + offs, mask=inside, other=0) != 0) & inside
    kn = tl.load(kn_ptr + vec + offs, mask=inside, other=0.0)
    vn = tl.load(vn_ptr + vec + offs, mask=inside, other=0.0)
    base = tl.zeros([BLOCK], dtype=tl.float32)
    if USE_KD:
        base = alpha * (kn * kn)
    if USE_VD:
        base = base + one_minus_alpha * (vn * vn)
    inv_kn = tl.where(kn > 0.0, 1.0 / tl.where(kn > 0.0, kn, 1.0), 0.0)
    inv_vn = tl.where(vn > 0.0, 1.0 / tl.where(vn > 0.0, vn, 1.0), 0.0)
    state = p * (9 * m_units)
    tl.store(state_ptr + state + offs, base, mask=inside)
    tl.store(state_ptr + state + m_units + offs, inv_kn, mask=inside)
    tl.store(state_ptr + state + 2 * m_units + offs, inv_vn, mask=inside)
    tl.debug_barrier()  # the terms, read back by other threads
    # The seed: the lowest index within tol (relative) of the best seed score.
    seed = tl.where(valid, tl.load(seed_ptr + vec + offs, mask=inside, other=0.0), float("-inf"))
    best = tl.max(seed, 0)
    j = tl.min(tl.where(valid & (seed >= best - tol * tl.maximum(best, 0.0)), offs, BLOCK), 0)

    k_p = tl.load(k_ptr + p)
    # The pool lives in the running distance: -inf marks a unit out of it (invalid, or chosen), and a unit in it has
    # a distance >= 0 (snapped distances are), so |min_dist| is +inf out of the pool and min |x| is the pool's minimum.
    min_dist = tl.where(valid, float("inf"), float("-inf"))
    run_k = tl.where(valid, 2.0, float("-inf"))
    run_v = tl.where(valid, 2.0, float("-inf"))
    thr_k, thr_v, res_k, res_v, dirs_k, dirs_v, f_row, b_key, b_value = _exact_start(
        kn, vn, min_dist, p, tol, f_problem, b_rows, comp_dim, USE_KO, USE_VO, EXACT)
    # A problem runs its own k[p] steps (at most k_max: a step's problems share the launch, each its own budget,
    # and a frame compression sized by the host's bound takes its budget from the device), then pads its row with -1.
    steps = tl.minimum(k_p, k_max).to(tl.int32)
    for t0 in range(steps, k_max, BLOCK):
        tail = t0 + offs
        tl.store(out_ptr + p * k_max + tail, tl.full([BLOCK], -1, tl.int64), mask=tail < k_max)
    # Steps on the whole row, then, once the pool fits in half of it, on the pool alone (COMPACT): a step's work
    # follows the units still in the pool, not those the region started with.
    t_half = steps
    if COMPACT and not EXACT:
        t_half = tl.minimum(tl.maximum(tl.sum(valid.to(tl.int32), 0) - BLOCK // 2, 0), steps)
    for t in range(0, t_half):
        j, min_dist, run_k, run_v, res_k, res_v, dirs_k, dirs_v = _step(
            t, j, min_dist, run_k, run_v, res_k, res_v, dirs_k, dirs_v, thr_k, thr_v, offs, offs, inside, state, state,
            p, gk_ptr, gv_ptr, out_ptr, state_ptr, feats_ptr, basis_ptr, proj_ptr, m_units, k_max, gram_stride, f_row,
            f_unit, comp_dim, value_off, b_key, b_value, b_rows, vec, eta, one_minus_eta, lam, eps0, tol, neg_snap,
            neg2a, neg2b, USE_KD, USE_VD, USE_KO, USE_VO, EXACT, BLOCK, BLOCK, BLOCK_D, BLOCK_S)
    if COMPACT and not EXACT:  # noqa: SIM102 (a compile-time branch: the code below is not built without it)
        if t_half < steps:
            ids, at, held, packed, pool_d, pool_k, pool_v = _compact_pool(
                state_ptr, ids_ptr, state, vec, offs, min_dist, run_k, run_v, m_units, BLOCK)
            for t in range(t_half, steps):
                j, pool_d, pool_k, pool_v, res_k, res_v, dirs_k, dirs_v = _step(
                    t, j, pool_d, pool_k, pool_v, res_k, res_v, dirs_k, dirs_v, thr_k, thr_v, ids, at, held, state,
                    packed, p, gk_ptr, gv_ptr, out_ptr, state_ptr, feats_ptr, basis_ptr, proj_ptr, m_units, k_max,
                    gram_stride, f_row, f_unit, comp_dim, value_off, b_key, b_value, b_rows, vec, eta,
                    one_minus_eta, lam, eps0, tol, neg_snap, neg2a, neg2b, USE_KD, USE_VD, USE_KO, USE_VO, EXACT,
                    BLOCK // 2, BLOCK, BLOCK_D, BLOCK_S)


@device_function
def _exact_start(kn, vn, min_dist, p, tol, f_problem, b_rows, comp_dim,
                 USE_KO: tl.constexpr, USE_VO: tl.constexpr, EXACT: tl.constexpr):
    """The exact novelty's state before the first step (read only by it; without ``EXACT``, placeholders): the
    squared residuals' snapping thresholds and the residuals (``[BLOCK]`` each, keys then values: the squared norms
    ``kn``, ``vn``, 0 only for zero vectors, as the reference's), the directions so far (0 of each), where problem
    ``p``'s features start (``f_row``) and where its keys' and values' directions do (``b_key``, ``b_value``: a block
    of ``b_rows`` directions of ``comp_dim`` per component the novelty reads, keys first)."""
    thr_k, thr_v, res_k, res_v = min_dist, min_dist, min_dist, min_dist
    dirs_k, dirs_v = tl.zeros([], dtype=tl.int32), tl.zeros([], dtype=tl.int32)
    f_row, b_key, b_value = p, p, p
    if EXACT:  # squared residuals start as the squared norms (0 only for zero vectors), as the reference's
        thr_k = tol * (kn * kn)
        thr_v = tol * (vn * vn)
        res_k = tl.where(kn * kn <= thr_k, 0.0, kn * kn)
        res_v = tl.where(vn * vn <= thr_v, 0.0, vn * vn)
        dirs_k = tl.zeros([], dtype=tl.int32)
        dirs_v = tl.zeros([], dtype=tl.int32)
        f_row = p * f_problem
        b_key = p * (b_rows * comp_dim)  # a block of directions per component the novelty reads, keys first
        if USE_KO and USE_VO:
            b_key = 2 * b_key
        b_value = b_key
        if USE_KO:
            b_value = b_key + b_rows * comp_dim
    return thr_k, thr_v, res_k, res_v, dirs_k, dirs_v, f_row, b_key, b_value


@device_function
def _compact_pool(state_ptr, ids_ptr, state, vec, offs, min_dist, run_k, run_v, m_units, BLOCK: tl.constexpr):
    """The pool (the unit chosen last included: it leaves at the next step) in index order, half as wide: its units'
    indices (to ``ids[vec ...]``), running state (distance ``min_dist``, key and value novelty ``run_k``, ``run_v``:
    ``[BLOCK]``) and terms (a second set of rows, ``state[packed + r * m_units]``), each written where its rank puts
    it. It holds n_valid - t_half <= BLOCK // 2 units: each step takes one of the pool's (a score that is NaN, from
    Gram entries past float32's range, could break that; what is past the half is left out). Returns the packed
    pool's indices, slots (``at``) and which slots hold a unit (``held``), ``packed``, and its running state, each
    ``[BLOCK // 2]``."""
    keep = min_dist > float("-inf")
    rank = tl.cumsum(keep.to(tl.int32), 0) - 1
    count = tl.sum(keep.to(tl.int32), 0)
    packed = state + 3 * m_units
    running = state + 6 * m_units
    tl.store(ids_ptr + vec + rank, offs, mask=keep)
    for r in tl.static_range(3):  # the terms, from their rows (not kept in registers through the steps)
        term = tl.load(state_ptr + state + r * m_units + offs, mask=keep, other=0.0)
        tl.store(state_ptr + packed + r * m_units + rank, term, mask=keep)
    tl.store(state_ptr + running + rank, min_dist, mask=keep)
    tl.store(state_ptr + running + m_units + rank, run_k, mask=keep)
    tl.store(state_ptr + running + 2 * m_units + rank, run_v, mask=keep)
    tl.debug_barrier()  # written by other threads, read back below
    at = tl.arange(0, BLOCK // 2)
    held = at < count
    ids = tl.load(ids_ptr + vec + at, mask=held, other=0)
    pool_d = tl.load(state_ptr + running + at, mask=held, other=float("-inf"))
    pool_k = tl.load(state_ptr + running + m_units + at, mask=held, other=float("-inf"))
    pool_v = tl.load(state_ptr + running + 2 * m_units + at, mask=held, other=float("-inf"))
    return ids, at, held, packed, pool_d, pool_k, pool_v


@device_function
def _step(t, j, min_dist, run_k, run_v, res_k, res_v, dirs_k, dirs_v, thr_k, thr_v, ids, at, inside, state, terms, p,
          gk_ptr, gv_ptr, out_ptr, state_ptr, feats_ptr, basis_ptr, proj_ptr, m_units, k_max, gram_stride, f_row,
          f_unit, comp_dim, value_off, b_key, b_value, b_rows, vec, eta, one_minus_eta, lam, eps0, tol, neg_snap,
          neg2a, neg2b, USE_KD: tl.constexpr, USE_VD: tl.constexpr, USE_KO: tl.constexpr, USE_VO: tl.constexpr,
          EXACT: tl.constexpr, BLOCK: tl.constexpr, NONE: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_S: tl.constexpr):
    """One greedy step of :func:`_greedy_kernel` over ``BLOCK`` units: records ``j`` (chosen by the step before) as
    the ``t``-th, folds it into the state and chooses the next. ``ids`` (``[BLOCK]``) are the units' indices (the
    Gram rows' columns; the tie rule's order), ``at`` where their terms are in the rows at ``terms``
    (``state[terms + r * m_units + at]``: ``r`` = 0 the squared-norm sum, 1 and 2 the reciprocal key and value
    norms; the chosen unit's are read at ``state[state + r * m_units + j]``), ``inside`` which are units at
    all. ``NONE``: the index no unit has. Returns the state, ``j`` the next unit."""
    tl.store(out_ptr + p * k_max + t, j.to(tl.int64))
    j = tl.minimum(j, m_units - 1)  # stay in bounds, whatever the pool holds
    chosen = state + j
    row = p * gram_stride + j.to(tl.int64) * m_units
    if USE_KD or (USE_KO and not EXACT):
        gk = tl.load(gk_ptr + row + ids, mask=inside, other=0.0)
    if USE_VD or (USE_VO and not EXACT):
        gv = tl.load(gv_ptr + row + ids, mask=inside, other=0.0)
    base_j = tl.load(state_ptr + chosen)
    base = tl.load(state_ptr + terms + at, mask=inside, other=0.0)
    bsum = base + base_j
    dist = bsum
    if USE_KD:
        dist = dist + neg2a * gk
    if USE_VD:
        dist = dist + neg2b * gv
    dist = tl.where(dist <= bsum * tol, 0.0, dist)  # snapped to 0 (negative ones too)
    min_dist = tl.where(ids == j, float("-inf"), tl.minimum(min_dist, dist))  # j leaves the pool

    if USE_KO or USE_VO:
        orth = tl.zeros([BLOCK], dtype=tl.float32)
        if EXACT:
            if USE_KO:
                res_k, dirs_k = _exact_residual(res_k, thr_k, dirs_k, j, ids, inside, m_units, feats_ptr, f_row,
                                                f_unit, 0, comp_dim, basis_ptr, b_key, b_rows, proj_ptr, vec,
                                                BLOCK_D, BLOCK_S)
                orth = res_k * eta
            if USE_VO:
                res_v, dirs_v = _exact_residual(res_v, thr_v, dirs_v, j, ids, inside, m_units, feats_ptr, f_row,
                                                f_unit, value_off, comp_dim, basis_ptr, b_value, b_rows, proj_ptr,
                                                vec, BLOCK_D, BLOCK_S)
                orth = orth + res_v * one_minus_eta
        else:
            if USE_KO:
                inv_kn_j = tl.load(state_ptr + chosen + m_units)
                inv_kn = tl.load(state_ptr + terms + m_units + at, mask=inside, other=0.0)
                ncos = (gk * -inv_kn_j) * inv_kn  # the sign on the scalar: a product's is exact wherever it goes
                run_k = tl.minimum(run_k, tl.where(ncos > neg_snap, ncos, -1.0) + 1.0)
                orth = run_k * eta
            if USE_VO:
                inv_vn_j = tl.load(state_ptr + chosen + 2 * m_units)
                inv_vn = tl.load(state_ptr + terms + 2 * m_units + at, mask=inside, other=0.0)
                ncos = (gv * -inv_vn_j) * inv_vn
                run_v = tl.minimum(run_v, tl.where(ncos > neg_snap, ncos, -1.0) + 1.0)
                orth = orth + run_v * one_minus_eta  # + 0 is exact: the key term alone when the keys have none
        # The novelty is >= 0 in the pool; adding min(min_dist, 0) (0 there, -inf out of it) leaves it there and
        # marks the rest -inf, as the distance is.
        orth = orth + tl.minimum(min_dist, 0.0)
        # The pool's range of both rows in one reduction, for the distance and the novelty.
        ranges = tl.max(tl.join(_range_keys(min_dist), _range_keys(orth)), 0)
        dist_range, orth_range = tl.split(ranges)
        hi, neg_lo = _range_of(dist_range)
        hi_o, neg_lo_o = _range_of(orth_range)
        score = ((min_dist + neg_lo) * (1.0 / (tl.maximum(hi + neg_lo, 0.0) + eps0))
                 + (orth + neg_lo_o) * (lam / (tl.maximum(hi_o + neg_lo_o, 0.0) + eps0)))
    else:
        hi, neg_lo = _range_of(tl.max(_range_keys(min_dist), 0))
        score = (min_dist + neg_lo) * (1.0 / (tl.maximum(hi + neg_lo, 0.0) + eps0))
    # Out of the pool the score is -inf: its terms are, and their scales are > 0 (a range is >= 0, the max with 0
    # only keeps an empty pool's -inf range from making them NaN). In it the score is >= 0 (a term is a
    # difference >= 0 times a scale > 0), so its maximum is that of its bits (:func:`_range_keys`).
    best = tl.max(score.to(tl.int32, bitcast=True), 0).to(tl.float32, bitcast=True) - tol
    j = tl.min(tl.where(score >= best, ids, NONE), 0)
    return j, min_dist, run_k, run_v, res_k, res_v, dirs_k, dirs_v


def compiled(interpret: bool):
    """The kernel, jitted on first use (under the interpreter when ``TRITON_INTERPRET=1`` at that time), with the
    arguments of :data:`NOT_SPECIALIZED` left unspecialized."""
    return jitted(_greedy_kernel, interpret)


@contextlib.contextmanager
def _ieee_fp32() -> Iterator[None]:
    """fp32 matmuls in full precision (no TF32) inside the block, whatever the process set."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@functools.cache
def _say_once(reason: str) -> None:
    logger.info("cords-vllm: a greedy selection ran on the PyTorch path: %s", reason)


def _warps(block: int) -> int:
    """Warps per program: the fastest of 4-32 on an H100 at 484, 1,280 and 7,680 units (a step's reductions span
    the program, so more warps pay only when each holds enough units)."""
    return 4 if block <= 64 else 8 if block <= 256 else 16 if block <= 4096 else 32


def unit_width(block: int) -> dict[str, int]:
    """The kernel's width at ``block`` units (a power of two, at least 16): its ``BLOCK``, warps and whether it
    compacts the pool (:data:`COMPACT_FROM`), the only settings of its launch that change with a run's size (the
    others follow the model and the policy)."""
    return {"BLOCK": block, "num_warps": _warps(block), "COMPACT": block >= COMPACT_FROM}


def cords_greedy_triton(feats: torch.Tensor, key_dim: int, valid: torch.Tensor, k: torch.Tensor, k_max: int, *,
                        alpha: float, eta: float, lam: float, eps0: float, novelty: str) -> torch.Tensor | None:
    """:func:`~cords_vllm.selection.cords.cords_greedy` (same arguments, same result) in one kernel launch.

    ``feats``: ``[P, M, Dk + Dv]`` in the compute dtype (float32; other dtypes return ``None``); ``valid``:
    ``bool [P, M]``; ``k``: ``long [P]``. Returns ``long [P, k_max]``, or ``None`` when the problem is not one
    the kernel takes (float64, more than :data:`MAX_UNITS` units or Gram matrices past :data:`GRAM_LIMIT_BYTES`):
    the caller then runs the PyTorch path. Raises the reference's ``ValueError`` where the exact novelty reads keys
    and values of different widths.
    """
    p_count, m_units, f_dim = feats.shape
    params = GreedyParams(alpha, eta, lam, eps0, novelty)
    terms = _Terms.of(params)
    if terms.exact and terms.use_ko and terms.use_vo and 2 * key_dim != f_dim:
        raise ValueError("feats: exact novelty on keys and values needs Dk == Dv")
    if feats.dtype != torch.float32:
        _say_once(f"features in {feats.dtype} (the kernel computes in float32)")
        return None
    if m_units > MAX_UNITS or p_count * m_units * m_units * 4 * (terms.gram_k + terms.gram_v) > GRAM_LIMIT_BYTES:
        _say_once(f"{p_count} problem(s) of {m_units} units exceed the kernel's limits ({MAX_UNITS} units, "
                  f"{GRAM_LIMIT_BYTES >> 30} GiB of Gram matrices)")
        return None
    # Every run in the variant the fused step's runs compile (:mod:`cords_vllm.compress.kernel_warmup`): int8
    # validity, and the units padded with invalid ones to a multiple of UNIT_ROWS (the kernel specializes on the unit
    # count: its Gram rows' alignment).
    pad = -m_units % UNIT_ROWS
    valid = valid.to(torch.int8)
    if pad:
        feats = torch.nn.functional.pad(feats, (0, 0, 0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))
        m_units += pad
    keys, values = feats[..., :key_dim], feats[..., key_dim:]
    kn = torch.linalg.vector_norm(keys, dim=-1) if terms.need_k else feats.new_zeros((p_count, m_units))
    vn = torch.linalg.vector_norm(values, dim=-1) if terms.need_v else kn
    # The reference's seed score (cords_torch._seed): ||k + v||, or the norm of the one space the distance reads.
    seed = torch.linalg.vector_norm(keys + values, dim=-1) if terms.use_kd and terms.use_vd else None
    return greedy_from_units(feats, key_dim, kn, vn, seed, valid, k, k_max, params)


@dataclass(frozen=True)
class _Terms:
    """Which terms of the score a run computes (those that cannot change it are left out, as the reference does):
    the distance's key and value terms, the novelty's, and which Gram matrices they read."""

    use_kd: bool
    use_vd: bool
    use_ko: bool
    use_vo: bool
    exact: bool

    @classmethod
    def of(cls, params: GreedyParams) -> _Terms:
        use_orth = params.lam > 0.0
        return cls(params.alpha > 0.0, params.alpha < 1.0, use_orth and params.eta > 0.0,
                   use_orth and params.eta < 1.0, use_orth and params.novelty == "exact")

    @property
    def need_k(self) -> bool:
        """Whether the score reads the keys (their norms)."""
        return self.use_kd or self.use_ko

    @property
    def need_v(self) -> bool:
        """Whether the score reads the values (their norms)."""
        return self.use_vd or self.use_vo

    @property
    def gram_k(self) -> bool:
        """Whether the run reads ``K K^T``: the distance's key term, or the max-cosine novelty of the keys."""
        return self.use_kd or (self.use_ko and not self.exact)

    @property
    def gram_v(self) -> bool:
        """Whether the run reads ``V V^T``."""
        return self.use_vd or (self.use_vo and not self.exact)


def greedy_from_units(feats: torch.Tensor, key_dim: int, kn: torch.Tensor, vn: torch.Tensor,
                      seed: torch.Tensor | None, valid: torch.Tensor, k: torch.Tensor, k_max: int,
                      params: GreedyParams) -> torch.Tensor:
    """The Gram matrices and the greedy kernel, on units whose norms are known: ``feats`` ``float32 [P, M, Dk + Dv]``
    (``Dk == Dv`` where the exact novelty reads both); ``kn`` / ``vn`` / ``seed``: ``float32 [P, M]`` norms of the
    keys, of the values and of their sum (``seed`` is read only where the distance reads both spaces: ``None`` is
    allowed elsewhere); ``valid``: ``bool`` or ``int8 [P, M]``; ``k``: ``long [P]``; ``params.space`` is not read
    (the features are ordered as given: a caller in the normalized space scales them first). Returns
    ``long [P, k_max]``.
    Three launches, whatever the novelty (two where the run reads one space only)."""
    p_count, m_units, f_dim = feats.shape
    alpha, eta, lam, eps0 = params.alpha, params.eta, params.lam, params.eps0
    terms = _Terms.of(params)
    keys, values = feats[..., :key_dim], feats[..., key_dim:]
    empty = feats.new_empty((1,))  # never read: the kernel skips its terms
    with _ieee_fp32():
        gk = torch.bmm(keys, keys.transpose(1, 2)) if terms.gram_k else empty
        gv = torch.bmm(values, values.transpose(1, 2)) if terms.gram_v else empty
    seed = seed if terms.use_kd and terms.use_vd else (kn if terms.use_kd else vn)
    out = torch.empty((p_count, k_max), dtype=torch.long, device=feats.device)
    # The kernel's scratch: the units' terms, the pool's terms and running state once compacted, the pool's indices.
    state = torch.empty((p_count, 9, m_units), dtype=torch.float32, device=feats.device)
    pool_ids = torch.empty((p_count, m_units), dtype=torch.int32, device=feats.device)
    tol = snap_tolerance(feats.dtype)
    # The exact novelty's directions, [P, C, b_rows, Dc] for the C components it reads (at most Dc per component:
    # they are orthonormal), and every unit's projection on the newest, [P, M].
    comp_dim = key_dim if terms.use_ko or not terms.use_vo else f_dim - key_dim
    b_rows = min(k_max, comp_dim)
    if terms.exact:
        feats = feats if feats.stride(-1) == 1 else feats.contiguous()
        n_basis = p_count * (terms.use_ko + terms.use_vo) * b_rows * comp_dim
        scratch = torch.empty(n_basis + p_count * m_units, dtype=torch.float32, device=feats.device)
        basis, proj = scratch[:n_basis], scratch[n_basis:]
    else:
        basis = proj = empty
    launch("greedy", compiled(interpreting()), (p_count,),
        gk, gv, kn.contiguous(), vn.contiguous(), seed.contiguous(), valid.contiguous(), k, out, state, pool_ids,
        feats, basis, proj, m_units, k_max, m_units * m_units, feats.stride(0), feats.stride(1), comp_dim, key_dim,
        b_rows,
        alpha, 1.0 - alpha, -2.0 * alpha, -2.0 * (1.0 - alpha), eta, 1.0 - eta, lam, eps0, tol, -(1.0 - tol),
        USE_KD=terms.use_kd, USE_VD=terms.use_vd, USE_KO=terms.use_ko, USE_VO=terms.use_vo, EXACT=terms.exact,
        **tiles(m_units, comp_dim),
        enable_fp_fusion=False)  # no fused multiply-adds: the reference's roundings, op for op
    return out


def tiles(m_units: int, comp_dim: int) -> dict[str, int]:
    """The greedy kernel's widths for ``m_units`` units of ``comp_dim`` channels per component: ``BLOCK`` (the units,
    a power of two), ``BLOCK_D`` (a component), the exact novelty's tile height (``BLOCK_S`` directions or units of
    ``BLOCK_D`` channels: about 4,096 elements) and the warps."""
    block_d = max(16, triton.next_power_of_2(comp_dim))
    return {**unit_width(max(16, triton.next_power_of_2(m_units))), "BLOCK_D": block_d,
            "BLOCK_S": max(1, min(64, 4096 // block_d))}
