"""CoRDS's greedy run (:func:`~cords_vllm.selection.cords.cords_greedy`) in PyTorch: the reference, and the path
that runs on CPU (:mod:`~cords_vllm.selection.cords_triton` runs it as one kernel), with the numerics
:mod:`cords_vllm.selection.cords` documents.

The fast implementation of Algorithm 1 of the CoRDS paper. One greedy step costs a single pass over the
``[M, Dk + Dv]`` features: one skinny matmul ``feats @ W`` (two or three columns, so it runs at memory
speed). With ``base_i = alpha |k_i|^2 + (1 - alpha) |v_i|^2`` precomputed, the bicriteria distance to
the new point ``j`` is ``d_alpha(i, j) = base_i + base_j - 2 (alpha k_i.k_j + (1 - alpha) v_i.v_j)``.

* max-cosine novelty: columns ``[k_j / |k_j|; 0]`` and ``[0; v_j / |v_j|]`` give ``|k_i| cos(k_i, k_j)``
  and ``|v_i| cos(v_i, v_j)``, hence both the cosines and the two dot products of the distance;
* exact novelty (or no bonus): one combined column ``[-2 alpha k_j; -2 (1 - alpha) v_j]`` for the
  distance, plus ``[q_K; 0]`` and ``[0; q_V]``, the new orthonormal key/value directions of the span of
  the selected set (incremental Gram-Schmidt); residuals shrink by the squared projections.

Everything else is ``O(M)`` vector state: the running minimum distance ``d_alpha(i, S)``, the squared
residuals ``||(I - P_S) k_i||^2`` / ``||(I - P_S) v_i||^2`` (or the running minimum ``1 - cos``), and
the pool (a unit out of it has ``-inf`` state). Time ``O(b * M * (Dk + Dv))``, memory ``O(M * (Dk + Dv))``;
no ``M x M`` matrix is formed.

Launches (on a GPU a step's small ops are bound by launch latency, and there is one step per kept unit): a
step is a fixed list of ops writing into buffers made once per run (``out=`` and in-place ops, views made
once), with no host read and no allocation but its pick: :data:`OPS_PER_GREEDY_STEP` aten ops, whatever ``M``
(30 with the default max-cosine novelty, 22 without a bonus, i.e. k_only, v_only and ``lam = 0``; 64 and 35
before they were fused), enforced by ``tests/compress/test_host_syncs.py``. Each element still goes through
the same arithmetic, op for op, so the selections are bit-identical to the unfused steps; fusing further
would change the rounding. The exact novelty, an ablation, runs more (its Gram-Schmidt step) and reads its
saturation flag back once per step from step ``Dc`` until its residuals vanish.

Structure: :class:`_Greedy` builds the state and buffers every step shares, then one step function per variant
(:func:`_d2_step` when ``lam = 0``, else :func:`_max_cosine_step` or :func:`_exact_step`), chosen once, adds the last
chosen unit and returns the next one (:func:`cords_greedy_torch`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from cords_vllm.selection.greedy_params import snap_tolerance
from cords_vllm.selection.ranking import mask_order

#: Aten ops (kernel launches, roughly: no view is counted because the steps make none) per greedy step, at
#: token and block granularity alike: ``max_cosine`` is the default CoRDS step, ``d2`` the step without a bonus
#: (k_only, v_only, ``lam = 0``). A budget enforced by ``tests/compress/test_host_syncs.py``.
OPS_PER_GREEDY_STEP: dict[str, int] = {"max_cosine": 30, "d2": 22}


def _first_near_max(score: torch.Tensor, out_of_pool: torch.Tensor, slack: torch.Tensor | float) -> torch.Tensor:
    """``long [P]``: lowest index ``i`` in the pool with ``score[i] >= max_pool(score) - slack``."""
    masked = score.masked_fill(out_of_pool, float("-inf"))
    best = masked.amax(-1, keepdim=True)
    return (masked >= best - slack).to(torch.uint8).argmax(-1)


def _new_direction(basis: torch.Tensor, t: int, x: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """Unit vector of the component of ``x`` outside ``span(basis[:, :t])`` (Gram-Schmidt, twice).

    ``basis`` is ``[P, T, D]`` with orthonormal (or zero) rows, ``x`` is ``[P, D]``, ``add`` is
    ``bool [P]``; rows where ``add`` is False get a zero vector (no new direction).
    """
    u = x
    if t > 0:
        q = basis[:, :t]
        for _ in range(2):  # classical Gram-Schmidt with one re-orthogonalisation pass
            # Row-vector products ([P, 1, D] @ [P, D, t]): much faster than matrix-vector bmm on CPU.
            coef = torch.bmm(u.unsqueeze(1), q.transpose(1, 2))  # [P, 1, t]
            u = u - torch.bmm(coef, q).squeeze(1)
    norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    drop = ~(add.unsqueeze(-1) & (norm > 0.0))
    return (u / norm.masked_fill(drop, 1.0)).masked_fill_(drop, 0.0)


def _padded_columns(n: int) -> int:
    """Columns of the per-step matmul: 3 is padded to 4 (a zero column), which CPU BLAS runs faster."""
    return 4 if n == 3 else n


def _inverse_norm(norm: torch.Tensor) -> torch.Tensor:
    """``1 / norm`` elementwise, ``0`` where ``norm`` is 0 (zero vectors have cosine 0 with everything)."""
    return torch.where(norm > 0, 1.0 / torch.where(norm > 0, norm, 1.0), 0.0)


class _Greedy:
    """State and buffers shared by every greedy step of one :func:`cords_greedy_torch` run (``P`` problems of ``M``
    units, ``F`` feature columns).

    A step writes only into these buffers (``out=`` and in-place ops) through views made once here, so it
    launches a fixed, short list of kernels, allocates nothing but its pick and never reads a tensor back.

    **The pool.** A unit leaves the pool (chosen, or invalid from the start) when its column of every row of
    :attr:`rows` is set to ``-inf`` (one ``scatter_`` per step). The running minimum keeps it there, and the
    novelty rows carry it into the novelty, so no step masks the pool again. In the pool every state entry is
    ``>= 0``, so a row's pool minimum is ``-max(-|row|)`` (``copysign``) and its pool maximum the row's
    maximum: one ``amax`` gives both for every row.

    Attributes
    ----------
    x:
        ``[P, M, F]``: the feature components the score reads: keys then values (``F = Dk + Dv``), or the
        keys alone (``F = Dk``) or the values alone (``F = Dv``); k_only / v_only read half the memory.
    dk:
        Width of the key part of ``x`` (``0`` when only values are read).
    need_k, need_v:
        Whether the score reads the keys / the values (distance or novelty).
    kn, vn:
        ``[P, M]`` key / value norms (zeros where not read).
    base:
        ``[P, M]``: ``alpha |k_i|^2 + (1 - alpha) |v_i|^2`` (the terms the distance uses).
    aux:
        ``[P, M, 5]``: ``base, |k|, |v|, 1/|k|, 1/|v|``, gathered for the new point in one op.
    valid:
        ``bool [P, M]``: selectable units (read by the seed only).
    alpha, lam, eps0, tol:
        As in :class:`~cords_vllm.selection.cords.CoRDSSelector`; ``tol`` is :func:`snap_tolerance`. Python
        scalars: a scalar operand is passed to the kernel, never copied to the device.
    use_kd, use_vd:
        Whether the distance has a key / value term.
    n_state:
        ``R``: state rows, 1 (distance) or 2 (distance, novelty).
    rows:
        ``[P, 2R + E, M]``: the state ``R`` rows (row 0: the running minimum distance ``d_alpha(i, S)``; row 1,
        with an orthogonal bonus, the novelty ``Orth(i | S)``), then ``R`` scratch rows ``-|state|``, then
        ``E`` rows the novelty keeps (its running minima, or the pool's ``0 / -inf`` row).
    w:
        ``[P, C, F]``: the columns of the per-step matmul ``x @ w^T`` (two or three, a skinny GEMM that runs
        at memory speed); ``prod`` ``[P, M, C]`` its result.
    dist_scale:
        ``[F]``: ``-2 alpha`` over the keys, ``-2 (1 - alpha)`` over the values; ``x_j * dist_scale`` is
        the combined distance column ``-2 (alpha k_j; (1 - alpha) v_j)``.
    j:
        ``long [P, 1]``: the unit chosen last; ``xj`` ``[P, 1, F]`` and ``aj`` ``[P, 1, 5]`` its features and
        constants.
    """

    def __init__(self, feats: torch.Tensor, key_dim: int, valid: torch.Tensor, *, alpha: float, eta: float,
                 lam: float, eps0: float, novelty: str) -> None:
        """Terms that cannot change the score are left out: the values at ``alpha = 1`` when the novelty does
        not read them, and so on. ``feats`` is ``[P, M, Dk + Dv]``, ``valid`` ``bool [P, M]``."""
        p_count, m_units, _ = feats.shape
        device, dtype = feats.device, feats.dtype
        self.tol = snap_tolerance(dtype)
        self.alpha, self.lam, self.eps0 = alpha, lam, eps0
        self.use_kd, self.use_vd = alpha > 0.0, alpha < 1.0
        use_orth = lam > 0.0
        use_ko, use_vo = use_orth and eta > 0.0, use_orth and eta < 1.0
        self.need_k, self.need_v = self.use_kd or use_ko, self.use_vd or use_vo

        # Work only on the components the score reads (k_only / v_only read half the memory).
        if self.need_k and self.need_v:
            x_all, dk = feats, key_dim
        elif self.need_k:
            x_all, dk = feats[..., :key_dim].contiguous(), key_dim
        else:
            x_all, dk = feats[..., key_dim:].contiguous(), 0
        self.x, self.dk, self.valid = x_all, dk, valid
        f_dim = x_all.shape[-1]
        zeros = torch.zeros((p_count, m_units), dtype=dtype, device=device)
        self.kn = torch.linalg.vector_norm(x_all[..., :dk], dim=-1) if self.need_k else zeros
        self.vn = torch.linalg.vector_norm(x_all[..., dk:], dim=-1) if self.need_v else zeros
        self.base = ((alpha * (self.kn * self.kn) if self.use_kd else zeros)
                     + ((1.0 - alpha) * (self.vn * self.vn) if self.use_vd else zeros))
        self.aux = torch.stack([self.base, self.kn, self.vn, _inverse_norm(self.kn), _inverse_norm(self.vn)],
                               dim=-1)
        self.dist_scale = torch.cat([torch.full((dk,), -2.0 * alpha, dtype=dtype, device=device),
                                     torch.full((f_dim - dk,), -2.0 * (1.0 - alpha), dtype=dtype, device=device)])

        # Columns of the per-step matmul. With the max-cosine surrogate the plain dots k.k_j and v.v_j serve
        # both the distance and the cosines; otherwise one combined distance column, plus the new directions.
        if not use_orth:
            n_cols = 1
        elif novelty == "exact":
            n_cols = 1 + use_ko + use_vo
        else:
            n_cols = self.need_k + self.need_v
        self._columns(_padded_columns(n_cols))

        self.n_state = 2 if use_orth else 1
        extra = (use_ko + use_vo) if use_orth and novelty != "exact" else int(use_orth)
        r = self.n_state
        self.rows = torch.zeros((p_count, 2 * r + extra, m_units), dtype=dtype, device=device)
        self.rows[:, 0].fill_(float("inf"))
        self.rows.masked_fill_(~valid[:, None, :], float("-inf"))
        self.state, self.negs = self.rows[:, :r], self.rows[:, r:2 * r]
        self.min_dist = self.rows[:, 0]
        self.orth = self.rows[:, 1] if use_orth else None
        self.stat_rows = self.rows[:, :2 * r]
        self.stats = torch.empty((p_count, 2 * r, 1), dtype=dtype, device=device)
        self.hi, self.neglo = self.stats[:, :r], self.stats[:, r:]
        self.den = torch.empty((p_count, r, 1), dtype=dtype, device=device)
        self.normed = torch.empty((p_count, r, m_units), dtype=dtype, device=device)
        self.normed_dist, self.normed_orth = self.normed[:, 0], self.normed[:, -1]
        self.score = torch.empty((p_count, m_units), dtype=dtype, device=device) if use_orth else self.normed_dist
        self.best = torch.empty((p_count, 1), dtype=dtype, device=device)
        self.hit = torch.empty((p_count, m_units), dtype=torch.uint8, device=device)
        self.bsum = torch.empty((p_count, m_units), dtype=dtype, device=device)
        self.dist = torch.empty((p_count, m_units), dtype=dtype, device=device)
        self.snap = torch.empty((p_count, m_units), dtype=torch.bool, device=device)

        self.j = torch.zeros((p_count, 1), dtype=torch.long, device=device)
        self.j_x = self.j[:, :, None].expand(p_count, 1, f_dim)
        self.j_aux = self.j[:, :, None].expand(p_count, 1, self.aux.shape[-1])
        self.j_rows = self.j[:, None, :].expand(p_count, self.rows.shape[1], 1)
        self.xj = torch.empty((p_count, 1, f_dim), dtype=dtype, device=device)
        self.aj = torch.empty((p_count, 1, self.aux.shape[-1]), dtype=dtype, device=device)
        self.base_j, self.kn_j, self.vn_j = self.aj[:, :, 0], self.aj[:, :, 1], self.aj[:, :, 2]  # [P, 1] each

    def _columns(self, n_cols: int) -> None:
        """(Re)allocate the matmul columns ``w`` (``[P, n_cols, F]``, zeros) and its result ``prod``."""
        p_count, m_units, f_dim = self.x.shape
        self.w = torch.zeros((p_count, n_cols, f_dim), dtype=self.x.dtype, device=self.x.device)
        self.w_t = self.w.transpose(1, 2)
        self.w_dist = self.w[:, :1]  # [P, 1, F]: the combined distance column (when there is one)
        self.prod = torch.empty((p_count, m_units, n_cols), dtype=self.x.dtype, device=self.x.device)
        self.prod_dist = self.prod[..., 0]

    def one_column(self) -> None:
        """Drop every column but the distance column (the novelty has saturated)."""
        self._columns(1)

    def take(self) -> None:
        """Remove the unit ``j`` from the pool; gather its features into ``xj`` and its constants into ``aj``."""
        self.rows.scatter_(2, self.j_rows, float("-inf"))
        torch.gather(self.x, 1, self.j_x, out=self.xj)
        torch.gather(self.aux, 1, self.j_aux, out=self.aj)

    def lower_min_dist(self) -> None:
        """Fold ``d_alpha(i, j)`` (in ``dist``, unclamped) into the running minimum distance.

        ``bsum`` (``base_i + base_j``, overwritten) scales the snapping threshold, which is ``>= 0``: a negative
        distance is snapped to 0 with the small ones (so no clamp is needed).
        """
        self.bsum.mul_(self.tol)
        torch.le(self.dist, self.bsum, out=self.snap)
        self.dist.masked_fill_(self.snap, 0.0)
        torch.minimum(self.min_dist, self.dist, out=self.min_dist)

    def pick(self) -> torch.Tensor:
        """The next unit (``long [P, 1]``, a copy of ``j``, which it also becomes): the best min-max normalised
        score over the pool (tie rule: lowest index).

        The score is the normalised distance, plus ``lam`` times the normalised novelty when the state has one.
        """
        torch.copysign(self.state, -1.0, out=self.negs)
        torch.amax(self.stat_rows, -1, keepdim=True, out=self.stats)  # pool max, then -(pool min), of each row
        torch.add(self.hi, self.neglo, out=self.den).add_(self.eps0)
        torch.add(self.state, self.neglo, out=self.normed).div_(self.den)
        if self.n_state == 2:
            torch.add(self.normed_dist, self.normed_orth, alpha=self.lam, out=self.score)
        torch.amax(self.score, -1, keepdim=True, out=self.best).sub_(self.tol)
        torch.ge(self.score, self.best, out=self.hit)  # out of the pool the score is -inf
        torch.argmax(self.hit, -1, keepdim=True, out=self.j)
        return self.j.clone()


def _seed(g: _Greedy) -> torch.Tensor:
    """``long [P]``: the first unit, ``argmax ||k_i + v_i||`` (``||k_i||`` / ``||v_i||`` at ``alpha = 1 / 0``)."""
    if g.use_kd and g.use_vd:
        score = torch.linalg.vector_norm(g.x[..., :g.dk] + g.x[..., g.dk:], dim=-1)
    else:
        score = g.kn if g.use_kd else g.vn
    out_of_pool = ~g.valid
    best = score.masked_fill(out_of_pool, float("-inf")).amax(-1, keepdim=True)
    return _first_near_max(score, out_of_pool, g.tol * best.clamp_min(0.0))


def _d2_step(g: _Greedy, t: int) -> torch.Tensor:
    """One step without the orthogonal bonus (``lam = 0``, or a saturated exact novelty): add ``g.j``, return
    the next unit (``long [P, 1]``).

    ``w`` has one column, ``x_j * dist_scale``; ``t`` (the step number) is unused. About 22 kernels.
    """
    g.take()
    torch.mul(g.xj, g.dist_scale, out=g.w_dist)
    torch.bmm(g.x, g.w_t, out=g.prod)  # [P, M, C]: the one pass over the features
    torch.add(g.base, g.base_j, out=g.bsum)  # base_i + base_j
    torch.add(g.bsum, g.prod_dist, out=g.dist)
    g.lower_min_dist()
    return g.pick()


class _MaxCosine:
    """State of the max-cosine novelty: ``1 - max_{j in S} cos(x_i, x_j)`` for the keys and/or the values.

    Columns of ``w``: ``k_j / |k_j|`` (whenever the keys are read) and ``v_j / |v_j|`` (whenever the values
    are): they yield ``|k_i| cos(k_i, k_j)`` (and so also the key dot of the distance), likewise for values.

    Attributes
    ----------
    running:
        ``[P, N, M]``: the running minimum ``1 - cos`` of each component with a weight (``N`` = 1 or 2; rows
        of ``g.rows``, so leaving the pool sets them to ``-inf``).
    prod_nov, neg_inv:
        ``[P, N, M]``: the matmul columns of those components (a view of ``g.prod``) and ``-1 / |x_i|``
        (``-0`` for zero vectors: their cosine is 0), so that their product is ``-cos``.
    ncos:
        ``[P, N, M]`` buffer: ``-cos``, then ``1 - cos`` (``0`` where ``cos >= 1 - tol``).
    orth_terms:
        Each running row and its weight in the novelty (``eta``, ``1 - eta``).
    dist_terms:
        The distance's matmul column, norm of the new point and scale, for the keys and/or the values.
    """

    def __init__(self, g: _Greedy, eta: float) -> None:
        """The initial state (empty selected set: novelty 2, above any ``1 - cos``)."""
        k_col = 0 if g.need_k else None
        v_col = (1 if g.need_k else 0) if g.need_v else None
        f_dim = g.x.shape[-1]
        # Fill the cosine columns of w: one product when both halves are as wide (the diagonal blocks).
        if k_col is not None and v_col is not None and 2 * g.dk == f_dim:
            p_count, n_cols = g.w.shape[:2]
            self.fills = [(g.xj.view(p_count, 2, g.dk), g.aj[:, 0, 3:5].unsqueeze(-1),
                           g.w.as_strided((p_count, 2, g.dk), (n_cols * f_dim, f_dim + g.dk, 1)))]
        else:
            self.fills = [(g.xj[:, 0, part], g.aj[:, 0, i:i + 1], g.w[:, col, part])
                          for col, part, i in ((k_col, slice(0, g.dk), 3), (v_col, slice(g.dk, f_dim), 4))
                          if col is not None]
        comps = [(col, norm, weight) for col, norm, weight in ((k_col, g.kn, eta), (v_col, g.vn, 1.0 - eta))
                 if weight > 0.0]
        first = 2 * g.n_state
        self.running = g.rows[:, first:first + len(comps)]
        self.running.masked_fill_(g.valid[:, None, :], 2.0)
        cols = [col for col, _, _ in comps]  # consecutive: (k_col, v_col) are (0, 1), or one of them
        self.prod_nov = g.prod[..., cols[0]:cols[-1] + 1].transpose(1, 2)
        self.neg_inv = torch.stack([-_inverse_norm(norm) for _, norm, _ in comps], dim=1)
        self.ncos = torch.empty_like(self.running)
        self.orth_terms = [(self.running[:, i], weight) for i, (_, _, weight) in enumerate(comps)]
        self.snap = 1.0 - g.tol
        # The distance terms: (k_i.k_j / |k_j|) * |k_j| * (-2 alpha), likewise for the values.
        self.dist_terms = [(g.prod[..., col], norm_j, scale) for used, col, norm_j, scale in (
            (g.use_kd, k_col, g.kn_j, -2.0 * g.alpha), (g.use_vd, v_col, g.vn_j, -2.0 * (1.0 - g.alpha))) if used]


def _max_cosine_step(g: _Greedy, nov: _MaxCosine, t: int) -> torch.Tensor:
    """One step with the max-cosine novelty: add ``g.j``, return the next unit (``t`` unused). About 30
    kernels, for any number of units."""
    g.take()
    for x, inv, out in nov.fills:
        torch.mul(x, inv, out=out)
    torch.bmm(g.x, g.w_t, out=g.prod)  # [P, M, C]: the one pass over the features

    torch.add(g.base, g.base_j, out=g.bsum)  # base_i + base_j
    (prod, norm_j, scale), *more = nov.dist_terms
    torch.addcmul(g.bsum, prod, norm_j, value=scale, out=g.dist)
    for prod, norm_j, scale in more:
        g.dist.addcmul_(prod, norm_j, value=scale)
    g.lower_min_dist()

    # 1 - cos, snapped to 0 where cos >= 1 - tol: -cos is kept where -cos > -(1 - tol), else set to -1.
    torch.mul(nov.prod_nov, nov.neg_inv, out=nov.ncos)
    torch.threshold_(nov.ncos, -nov.snap, -1.0)
    nov.ncos.add_(1.0)
    torch.minimum(nov.running, nov.ncos, out=nov.running)
    (running, weight), *more = nov.orth_terms
    torch.mul(running, weight, out=g.orth)
    for running, weight in more:
        g.orth.add_(running, alpha=weight)
    return g.pick()


class _ExactNovelty:
    """State of the exact novelty ``eta ||(I - P_S^K) k_i||^2 + (1 - eta) ||(I - P_S^V) v_i||^2``.

    The ``C`` components used (keys and/or values, ``C = 1`` or ``2``) are stacked so that their
    Gram-Schmidt steps and residual updates run as one batch. Columns of ``w``: 0 is the distance column,
    ``1 .. C`` the new orthonormal direction of each component.

    Attributes
    ----------
    offsets:
        Where each component starts in a feature row of ``x``.
    comp_dim:
        ``Dc``, the width of a component.
    basis:
        ``[P * C, k_max, Dc]``: orthonormal (or zero) directions, rows ordered (problem, component).
    res, res_thr:
        ``[P, C, M]``: squared residuals ``||(I - P_S) x_i||^2`` and their snapping threshold
        ``tol * |x_i|^2``.
    eta_w:
        ``[1, C, 1]``: ``eta`` for the keys, ``1 - eta`` for the values.
    pool:
        ``[P, M]`` row of ``g.rows``: ``0`` in the pool, ``-inf`` out of it (added to the novelty, whose
        residuals are clamped at 0 and so cannot carry the ``-inf`` themselves).
    saturated:
        Every residual is zero: the spans are the whole feature space and, since residuals never grow, the
        novelty stays identically zero (the remaining steps are those of ``lam = 0``).
    """

    def __init__(self, g: _Greedy, eta: float, k_max: int) -> None:
        """The initial state (empty selected set: residuals are the squared norms).

        Raises ``ValueError`` when both components are used and ``Dk != Dv``.
        """
        comps = [c for c, used in ((0, eta > 0.0), (1, eta < 1.0)) if used]  # 0 = keys, 1 = values
        f_dim = g.x.shape[-1]
        comp_dim = g.dk if comps == [0] else f_dim - g.dk
        if len(comps) == 2 and g.dk != comp_dim:
            raise ValueError("feats: exact novelty on keys and values needs Dk == Dv")
        p_count, n_c = g.x.shape[0], len(comps)
        norms2 = torch.stack([(g.kn * g.kn, g.vn * g.vn)[c] for c in comps], dim=1)  # [P, C, M]
        self.offsets = [0 if c == 0 else g.dk for c in comps]
        self.comp_dim = comp_dim
        self.res_thr = g.tol * norms2
        self.res = norms2.masked_fill(norms2 <= self.res_thr, 0.0)
        self.eta_w = torch.empty((1, n_c, 1), dtype=g.x.dtype, device=g.x.device)
        for i, c in enumerate(comps):
            self.eta_w[:, i].fill_((eta, 1.0 - eta)[c])  # a fill, not a host-to-device copy
        self.basis = torch.zeros((p_count * n_c, k_max, comp_dim), dtype=g.x.dtype, device=g.x.device)
        self.pool = g.rows[:, 2 * g.n_state]
        self.weighted = torch.empty_like(self.res)
        self.res_j = torch.empty((p_count, n_c, 1), dtype=g.x.dtype, device=g.x.device)
        self.j_res = g.j[:, None, :].expand(p_count, n_c, 1)
        self.proj = g.prod[..., 1:1 + n_c].transpose(1, 2)  # [P, C, M]
        # [P * C, Dc]: rows (problem, component); with both components a view of x_j = [k_j; v_j].
        xj = g.xj[:, 0]
        self.xc = xj.view(p_count * 2, comp_dim) if n_c == 2 else xj[:, self.offsets[0]:self.offsets[0] + comp_dim]
        self.w_dirs = [g.w[:, 1 + i, off:off + comp_dim] for i, off in enumerate(self.offsets)]
        self.saturated = False


def _exact_step(g: _Greedy, nov: _ExactNovelty, t: int) -> torch.Tensor:
    """Step ``t`` with the exact novelty: add ``g.j``, return the next unit.

    Once the novelty is saturated it is identically zero: the step is :func:`_d2_step` (one matmul column).
    Saturation is read back to the host once per step from step ``Dc`` on, until it happens (typically at
    once): the one host read of a greedy run, and only for this variant.
    """
    if nov.saturated:
        return _d2_step(g, t)
    g.take()
    torch.mul(g.xj, g.dist_scale, out=g.w_dist)
    p_count, n_c, dc = g.x.shape[0], len(nov.offsets), nov.comp_dim
    torch.gather(nov.res, 2, nov.j_res, out=nov.res_j)
    q = _new_direction(nov.basis, t, nov.xc, (nov.res_j > 0.0).reshape(-1))
    nov.basis[:, t] = q
    q = q.view(p_count, n_c, dc)
    for i, w_dir in enumerate(nov.w_dirs):
        w_dir.copy_(q[:, i])
    torch.bmm(g.x, g.w_t, out=g.prod)  # [P, M, C]: the one pass over the features

    torch.add(g.base, g.base_j, out=g.bsum)  # base_i + base_j
    torch.add(g.bsum, g.prod_dist, out=g.dist)
    g.lower_min_dist()
    nov.res.addcmul_(nov.proj, nov.proj, value=-1.0).clamp_min_(0.0)
    nov.res.masked_fill_(nov.res <= nov.res_thr, 0.0)
    torch.mul(nov.res, nov.eta_w, out=nov.weighted)
    torch.sum(nov.weighted, dim=1, out=g.orth)
    g.orth.add_(nov.pool)  # -inf out of the pool
    nxt = g.pick()
    # Residuals never grow: once they are all zero (after at least Dc picks) they stay zero. Drop the
    # direction columns; the novelty row stays 0 in the pool (its normalised value is 0, so the score is the
    # normalised distance), and the next steps are plain D^2 ones.
    if t + 1 >= dc and not bool(nov.res.any()):
        nov.saturated = True
        g.one_column()
    return nxt


def _step_function(g: _Greedy, novelty: str, eta: float, k_max: int) -> Callable[[int], torch.Tensor]:
    """The step of the run, ``t -> next unit``, bound to its novelty state: :func:`_d2_step` without a
    bonus (the state has no novelty row), else the step of ``novelty`` (one of
    :data:`~cords_vllm.selection.cords.NOVELTY_VARIANTS`)."""
    if g.n_state == 1:
        return partial(_d2_step, g)
    if novelty == "exact":
        return partial(_exact_step, g, _ExactNovelty(g, eta, k_max))
    return partial(_max_cosine_step, g, _MaxCosine(g, eta))


def cords_greedy_torch(feats: torch.Tensor, key_dim: int, valid: torch.Tensor, k: torch.Tensor, k_max: int, *,
                       alpha: float, eta: float, lam: float, eps0: float, novelty: str) -> torch.Tensor:
    """:func:`~cords_vllm.selection.cords.cords_greedy` (same arguments, same result; ``k_max >= 1``, ``novelty``
    one of :data:`~cords_vllm.selection.cords.NOVELTY_VARIANTS`) on the PyTorch path: ``feats`` ``[P, M, Dk + Dv]``,
    ``valid`` ``bool [P, M]``, ``k`` ``long [P]``; returns ``long [P, k_max]``, the seed first, ``-1`` after
    ``k[p]`` entries."""
    g = _Greedy(feats, key_dim, valid, alpha=alpha, eta=eta, lam=lam, eps0=eps0, novelty=novelty)
    step = _step_function(g, novelty, eta, k_max)  # chosen once for the whole run
    g.j.copy_(_seed(g).unsqueeze(-1))
    chosen = [g.j.clone()]
    for t in range(k_max - 1):
        chosen.append(step(t))
    return mask_order(torch.cat(chosen, dim=1), k)
