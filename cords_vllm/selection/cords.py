"""CoRDS: greedy D^2-style coreset selection in joint key-value space with an orthogonal bonus.

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
the pool mask. Time ``O(b * M * (Dk + Dv))``, memory ``O(M * (Dk + Dv))``; no ``M x M`` matrix is formed.

Numerics (documented because the brute-force reference applies the same rules):

* arithmetic runs in the compute dtype (float32; float64 for float64 inputs);
* ``d_alpha(i, j)`` is clamped at 0 and *snapped* to exactly 0 when ``<= tol * (base_i + base_j)``;
  a squared residual is snapped to 0 when ``<= tol * |x_i|^2``, and a selected point adds a new
  orthonormal direction only if its (snapped) residual is positive; a cosine ``>= 1 - tol`` counts as
  exactly 1. ``tol`` is :func:`snap_tolerance` of the compute dtype (``1e-4`` for float32, ``1e-12`` for
  float64): it makes duplicated tokens (common once a cache is stored in bf16) and saturated spans
  compare exactly equal, so that exact ties are decided by the tie rule and not by rounding noise;
* zero vectors have cosine 0 with everything;
* tie rule: the next unit is the *lowest-index* unit of the pool whose score is within ``tol`` of the
  pool's best score (the seed: within ``tol`` relative of the largest norm). Scores that tie in exact
  arithmetic (duplicated frames, symmetric configurations) can differ in the last bits depending on
  summation order (device, batch, centroid order); the slack makes such ties resolve the same way
  everywhere. Near-ties closer than ``tol`` are treated as ties.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.params import hyperparameter
from cords_vllm.selection.ranking import mask_order
from cords_vllm.selection.registry import register_selector

NOVELTY_VARIANTS: tuple[str, ...] = ("max_cosine", "exact")


def snap_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance below which distances, residuals and novelties count as exactly zero."""
    return 1e-12 if dtype == torch.float64 else 1e-4


def _first_near_max(score: torch.Tensor, out_of_pool: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
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
    drop = ~(add.unsqueeze(-1) & (norm > torch.zeros((), dtype=norm.dtype, device=norm.device)))
    return (u / norm.masked_fill(drop, 1.0)).masked_fill_(drop, 0.0)


def _padded_columns(n: int) -> int:
    """Columns of the per-step matmul: 3 is padded to 4 (a zero column), which CPU BLAS runs faster."""
    return 4 if n == 3 else n


def _inverse_norm(norm: torch.Tensor) -> torch.Tensor:
    """``1 / norm`` elementwise, ``0`` where ``norm`` is 0 (zero vectors have cosine 0 with everything)."""
    return torch.where(norm > 0, 1.0 / torch.where(norm > 0, norm, 1.0), 0.0)


@dataclass
class _Greedy:
    """State shared by every greedy step of one :func:`cords_greedy` run (``P`` problems of ``M`` units).

    Attributes
    ----------
    x:
        ``[P, M, F]``: the feature components the score reads: keys then values (``F = Dk + Dv``), or the
        keys alone (``F = Dk``) or the values alone (``F = Dv``); k_only / v_only read half the memory.
    dk:
        Width of the key part of ``x`` (``0`` when only values are read).
    need_k, need_v:
        Whether the score reads the keys / the values (distance or novelty).
    ar:
        ``long [P]``: ``0 .. P-1``, to gather the new point of every problem.
    kn, vn:
        ``[P, M]`` key / value norms (zeros where not read).
    base:
        ``[P, M]``: ``alpha |k_i|^2 + (1 - alpha) |v_i|^2`` (the terms the distance uses).
    aux:
        ``[P, M, 5]``: ``base, |k|, |v|, 1/|k|, 1/|v|``, gathered for the new point in one index op.
    w:
        ``[P, C, F]``: the columns of the per-step matmul ``x @ w^T``. Few columns: a skinny GEMM runs at
        memory speed.
    dist_scale:
        ``[F]``: ``-2 alpha`` over the keys, ``-2 (1 - alpha)`` over the values; ``x_j * dist_scale`` is
        the combined distance column ``-2 (alpha k_j; (1 - alpha) v_j)``.
    state:
        ``[P, R, M]``: row 0 is the running minimum distance ``d_alpha(i, S)``; row 1 (``R = 2``, with an
        orthogonal bonus) the novelty ``Orth(i | S)``. Both are min-max normalised over the pool.
    out_of_pool:
        ``bool [P, M]``: invalid or already selected units.
    alpha, lam:
        As in :class:`CoRDSSelector`; ``use_kd`` / ``use_vd``: whether the distance has a key / value term.
    tol, c_tol, c_eps0:
        :func:`snap_tolerance` (a float and a 0-dim tensor) and ``eps0`` (0-dim): a Python scalar in a
        binary op costs a conversion each time, which adds up over thousands of small per-step ops.
    """

    x: torch.Tensor
    dk: int
    need_k: bool
    need_v: bool
    ar: torch.Tensor
    kn: torch.Tensor
    vn: torch.Tensor
    base: torch.Tensor
    aux: torch.Tensor
    w: torch.Tensor
    dist_scale: torch.Tensor
    state: torch.Tensor
    out_of_pool: torch.Tensor
    alpha: float
    lam: float
    use_kd: bool
    use_vd: bool
    tol: float
    c_tol: torch.Tensor
    c_eps0: torch.Tensor

    @property
    def min_dist(self) -> torch.Tensor:
        """``[P, M]`` view of the running minimum distance ``d_alpha(i, S)``."""
        return self.state[:, 0]


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    """0-dim tensor of ``value`` with the dtype and device of ``like``."""
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _setup(feats: torch.Tensor, key_dim: int, valid: torch.Tensor, *, alpha: float, eta: float, lam: float,
           eps0: float, novelty: str) -> _Greedy:
    """The state shared by every step: features, per-unit constants, matmul columns, distance state, pool.

    ``feats`` is ``[P, M, Dk + Dv]``, ``valid`` ``bool [P, M]``. Terms that cannot change the score are
    left out: the values at ``alpha = 1`` when the novelty does not read them, and so on.
    """
    p_count, m_units, _ = feats.shape
    device, dtype = feats.device, feats.dtype
    tol = snap_tolerance(dtype)
    use_kd, use_vd = alpha > 0.0, alpha < 1.0
    use_orth = lam > 0.0
    use_ko, use_vo = use_orth and eta > 0.0, use_orth and eta < 1.0
    need_k, need_v = use_kd or use_ko, use_vd or use_vo

    # Work only on the components the score reads (k_only / v_only read half the memory).
    if need_k and need_v:
        x_all, dk = feats, key_dim
    elif need_k:
        x_all, dk = feats[..., :key_dim].contiguous(), key_dim
    else:
        x_all, dk = feats[..., key_dim:].contiguous(), 0
    f_dim = x_all.shape[-1]
    zeros = torch.zeros((p_count, m_units), dtype=dtype, device=device)
    kn = torch.linalg.vector_norm(x_all[..., :dk], dim=-1) if need_k else zeros
    vn = torch.linalg.vector_norm(x_all[..., dk:], dim=-1) if need_v else zeros
    base = (alpha * (kn * kn) if use_kd else zeros) + ((1.0 - alpha) * (vn * vn) if use_vd else zeros)
    aux = torch.stack([base, kn, vn, _inverse_norm(kn), _inverse_norm(vn)], dim=-1)

    # Columns of the per-step matmul. With the max-cosine surrogate the plain dots k.k_j and v.v_j serve
    # both the distance and the cosines; otherwise one combined distance column, plus the new directions.
    if not use_orth:
        n_cols = 1
    elif novelty == "exact":
        n_cols = 1 + use_ko + use_vo
    else:
        n_cols = need_k + need_v
    w = torch.zeros((p_count, _padded_columns(n_cols), f_dim), dtype=dtype, device=device)
    dist_scale = torch.cat([torch.full((dk,), -2.0 * alpha, dtype=dtype, device=device),
                            torch.full((f_dim - dk,), -2.0 * (1.0 - alpha), dtype=dtype, device=device)])

    state = torch.zeros((p_count, 2 if use_orth else 1, m_units), dtype=dtype, device=device)
    state[:, 0].fill_(float("inf"))
    return _Greedy(x=x_all, dk=dk, need_k=need_k, need_v=need_v, ar=torch.arange(p_count, device=device), kn=kn,
                   vn=vn, base=base, aux=aux, w=w, dist_scale=dist_scale, state=state, out_of_pool=~valid,
                   alpha=alpha, lam=lam, use_kd=use_kd, use_vd=use_vd, tol=tol, c_tol=_const(tol, feats),
                   c_eps0=_const(eps0, feats))


def _seed(g: _Greedy) -> torch.Tensor:
    """``long [P]``: the first unit, ``argmax ||k_i + v_i||`` (``||k_i||`` / ``||v_i||`` at ``alpha = 1 / 0``)."""
    if g.use_kd and g.use_vd:
        score = torch.linalg.vector_norm(g.x[..., :g.dk] + g.x[..., g.dk:], dim=-1)
    else:
        score = g.kn if g.use_kd else g.vn
    best = score.masked_fill(g.out_of_pool, float("-inf")).amax(-1, keepdim=True)
    return _first_near_max(score, g.out_of_pool, g.tol * best.clamp_min(0.0))


def _take(g: _Greedy, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Remove the new points ``j`` (``long [P]``) from the pool; return their features ``[P, F]`` and
    constants ``[P, 5]`` (``base_j, |k_j|, |v_j|, 1/|k_j|, 1/|v_j|``)."""
    g.out_of_pool.scatter_(1, j.unsqueeze(-1), True)
    return g.x[g.ar, j], g.aux[g.ar, j]


def _lower_min_dist(g: _Greedy, dist: torch.Tensor, base_sum: torch.Tensor) -> None:
    """Fold ``d_alpha(i, j)`` (``[P, M]``, unclamped) into the running minimum distance.

    ``base_sum`` (``[P, M]``: ``base_i + base_j``, overwritten) scales the snapping threshold.
    """
    dist = dist.clamp_min(0.0)
    dist.masked_fill_(dist <= base_sum.mul_(g.c_tol), 0.0)
    torch.minimum(g.min_dist, dist, out=g.min_dist)


def _pick(g: _Greedy) -> torch.Tensor:
    """``long [P]``: the next unit, the best min-max normalised score over the pool (tie rule: lowest index).

    The score is the normalised distance, plus ``lam`` times the normalised novelty when the state has one.
    """
    rows = g.out_of_pool.unsqueeze(1)
    lo = g.state.masked_fill(rows, float("inf")).amin(-1, keepdim=True)
    hi = g.state.masked_fill(rows, float("-inf")).amax(-1, keepdim=True)
    normed = (g.state - lo) / (hi - lo + g.c_eps0)
    score = normed[:, 0] if normed.shape[1] == 1 else torch.add(normed[:, 0], normed[:, 1], alpha=g.lam)
    return _first_near_max(score, g.out_of_pool, g.c_tol)


def _d2_step(g: _Greedy, t: int, j: torch.Tensor) -> torch.Tensor:
    """One step without the orthogonal bonus (``lam = 0``): add ``j`` (``long [P]``), return the next unit.

    ``w`` has one column, ``x_j * dist_scale``; ``t`` (the step number) is unused.
    """
    x, aux_j = _take(g, j)
    torch.mul(x, g.dist_scale, out=g.w[:, 0])
    prod = torch.bmm(g.x, g.w.transpose(1, 2))  # [P, M, C]: the one pass over the features
    base_sum = g.base + aux_j[:, 0:1]  # base_i + base_j
    _lower_min_dist(g, torch.add(base_sum, prod[..., 0]), base_sum)
    return _pick(g)


@dataclass
class _MaxCosine:
    """State of the max-cosine novelty: ``1 - max_{j in S} cos(x_i, x_j)`` for the keys and/or the values.

    Attributes
    ----------
    k_col, v_col:
        Columns of ``w`` holding ``k_j / |k_j|`` and ``v_j / |v_j|`` (whenever the keys / values are read):
        they yield ``|k_i| cos(k_i, k_j)`` (and so also the key dot of the distance), likewise for values.
    inv_kn, inv_vn:
        ``[P, M]``: ``1 / |k_i|``, ``1 / |v_i|`` (0 for zero vectors: their cosine is 0).
    nov_k, nov_v:
        ``[P, M]`` running minimum ``1 - cos`` of the keys / values (``None`` when its weight is 0).
    eta:
        Key/value weight of the novelty.
    c_one, c_snap_cos, c_eta, c_eta_v:
        0-dim constants ``1``, ``1 - tol``, ``eta``, ``1 - eta``.
    """

    k_col: int | None
    v_col: int | None
    inv_kn: torch.Tensor
    inv_vn: torch.Tensor
    nov_k: torch.Tensor | None
    nov_v: torch.Tensor | None
    eta: float
    c_one: torch.Tensor
    c_snap_cos: torch.Tensor
    c_eta: torch.Tensor
    c_eta_v: torch.Tensor

    @classmethod
    def create(cls, g: _Greedy, eta: float) -> _MaxCosine:
        """The initial state (empty selected set: novelty 2, above any ``1 - cos``)."""
        k_col = 0 if g.need_k else None
        v_col = (1 if g.need_k else 0) if g.need_v else None
        nov_k = torch.full_like(g.base, 2.0) if eta > 0.0 else None
        nov_v = torch.full_like(g.base, 2.0) if eta < 1.0 else None
        return cls(k_col=k_col, v_col=v_col, inv_kn=_inverse_norm(g.kn), inv_vn=_inverse_norm(g.vn), nov_k=nov_k,
                   nov_v=nov_v, eta=eta, c_one=_const(1.0, g.base), c_snap_cos=_const(1.0 - g.tol, g.base),
                   c_eta=_const(eta, g.base), c_eta_v=_const(1.0 - eta, g.base))


def _max_cosine_step(g: _Greedy, nov: _MaxCosine, t: int, j: torch.Tensor) -> torch.Tensor:
    """One step with the max-cosine novelty: add ``j`` (``long [P]``), return the next unit (``t`` unused)."""
    x, aux_j = _take(g, j)
    if nov.k_col is not None:
        torch.mul(x[:, :g.dk], aux_j[:, 3:4], out=g.w[:, nov.k_col, :g.dk])
    if nov.v_col is not None:
        torch.mul(x[:, g.dk:], aux_j[:, 4:5], out=g.w[:, nov.v_col, g.dk:])
    prod = torch.bmm(g.x, g.w.transpose(1, 2))  # [P, M, C]: the one pass over the features

    base_sum = g.base + aux_j[:, 0:1]  # base_i + base_j
    dist = base_sum  # k_i.k_j = |k_j| * (column k_col), likewise for values
    if g.use_kd:
        dist = torch.addcmul(dist, prod[..., nov.k_col], aux_j[:, 1:2], value=-2.0 * g.alpha)
    if g.use_vd:
        dist = torch.addcmul(dist, prod[..., nov.v_col], aux_j[:, 2:3], value=-2.0 * (1.0 - g.alpha))
    _lower_min_dist(g, dist, base_sum)

    for col, inv, running in ((nov.k_col, nov.inv_kn, nov.nov_k), (nov.v_col, nov.inv_vn, nov.nov_v)):
        if running is None:
            continue
        cos = prod[..., col] * inv
        cos.masked_fill_(cos >= nov.c_snap_cos, 1.0)
        torch.minimum(running, nov.c_one - cos, out=running)
    orth = g.state[:, 1]
    if nov.nov_k is not None and nov.nov_v is not None:
        torch.mul(nov.nov_k, nov.c_eta, out=orth)
        orth.add_(nov.nov_v, alpha=1.0 - nov.eta)
    elif nov.nov_k is not None:
        torch.mul(nov.nov_k, nov.c_eta, out=orth)
    elif nov.nov_v is not None:
        torch.mul(nov.nov_v, nov.c_eta_v, out=orth)
    return _pick(g)


@dataclass
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
    c_zero:
        0-dim ``0``.
    saturated:
        Every residual is zero: the spans are the whole feature space and, since residuals never grow, the
        novelty stays identically zero (the remaining steps are those of ``lam = 0``).
    """

    offsets: list[int]
    comp_dim: int
    basis: torch.Tensor
    res: torch.Tensor
    res_thr: torch.Tensor
    eta_w: torch.Tensor
    c_zero: torch.Tensor
    saturated: bool = False

    @classmethod
    def create(cls, g: _Greedy, eta: float, k_max: int) -> _ExactNovelty:
        """The initial state (empty selected set: residuals are the squared norms).

        Raises ``ValueError`` when both components are used and ``Dk != Dv``.
        """
        comps = [c for c, used in ((0, eta > 0.0), (1, eta < 1.0)) if used]  # 0 = keys, 1 = values
        f_dim = g.x.shape[-1]
        comp_dim = g.dk if comps == [0] else f_dim - g.dk
        if len(comps) == 2 and g.dk != comp_dim:
            raise ValueError("feats: exact novelty on keys and values needs Dk == Dv")
        p_count = g.x.shape[0]
        norms2 = torch.stack([(g.kn * g.kn, g.vn * g.vn)[c] for c in comps], dim=1)  # [P, C, M]
        res_thr = g.tol * norms2
        eta_w = torch.tensor([(eta, 1.0 - eta)[c] for c in comps], dtype=g.x.dtype, device=g.x.device)
        return cls(offsets=[0 if c == 0 else g.dk for c in comps], comp_dim=comp_dim,
                   basis=torch.zeros((p_count * len(comps), k_max, comp_dim), dtype=g.x.dtype, device=g.x.device),
                   res=norms2.masked_fill(norms2 <= res_thr, 0.0), res_thr=res_thr,
                   eta_w=eta_w.view(1, len(comps), 1), c_zero=_const(0.0, g.x))


def _exact_step(g: _Greedy, nov: _ExactNovelty, t: int, j: torch.Tensor) -> torch.Tensor:
    """Step ``t`` with the exact novelty: add ``j`` (``long [P]``), return the next unit.

    Once the novelty is saturated it is identically zero: the step is :func:`_d2_step` (one matmul column).
    """
    if nov.saturated:
        return _d2_step(g, t, j)
    x, aux_j = _take(g, j)
    torch.mul(x, g.dist_scale, out=g.w[:, 0])
    p_count, n_c, dc = x.shape[0], len(nov.offsets), nov.comp_dim
    # [P * C, Dc]: rows (problem, component); with both components a view of x = [k_j; v_j].
    xc = x.view(p_count * 2, dc) if n_c == 2 else x[:, nov.offsets[0]:nov.offsets[0] + dc]
    q = _new_direction(nov.basis, t, xc, (nov.res[g.ar, :, j] > nov.c_zero).reshape(-1))
    nov.basis[:, t] = q
    q = q.view(p_count, n_c, dc)
    for i, off in enumerate(nov.offsets):
        g.w[:, 1 + i, off:off + dc] = q[:, i]
    prod = torch.bmm(g.x, g.w.transpose(1, 2))  # [P, M, C]: the one pass over the features

    base_sum = g.base + aux_j[:, 0:1]  # base_i + base_j
    _lower_min_dist(g, torch.add(base_sum, prod[..., 0]), base_sum)
    proj = prod[..., 1:1 + n_c].transpose(1, 2)  # [P, C, M]
    nov.res.addcmul_(proj, proj, value=-1.0).clamp_min_(0.0)
    nov.res.masked_fill_(nov.res <= nov.res_thr, 0.0)
    torch.sum(nov.res * nov.eta_w, dim=1, out=g.state[:, 1])
    nxt = _pick(g)
    # Residuals never grow: once they are all zero (after at least Dc picks) they stay zero. Drop the
    # direction columns and the novelty row; the next steps are plain D^2 ones.
    if t + 1 >= dc and not bool(nov.res.any()):
        nov.saturated = True
        g.w = g.w.new_zeros(p_count, 1, g.w.shape[-1])
        g.state = g.state[:, :1]
    return nxt


def _step_function(g: _Greedy, novelty: str, eta: float, k_max: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """The step of the run, ``(t, j) -> next unit``, bound to its novelty state: :func:`_d2_step` without a
    bonus (the state has no novelty row), else the step of ``novelty`` (one of :data:`NOVELTY_VARIANTS`)."""
    if g.state.shape[1] == 1:
        return partial(_d2_step, g)
    if novelty == "exact":
        return partial(_exact_step, g, _ExactNovelty.create(g, eta, k_max))
    return partial(_max_cosine_step, g, _MaxCosine.create(g, eta))


def cords_greedy(
    feats: torch.Tensor,
    key_dim: int,
    valid: torch.Tensor,
    k: torch.Tensor,
    k_max: int,
    *,
    alpha: float,
    eta: float,
    lam: float,
    eps0: float,
    novelty: str,
) -> torch.Tensor:
    """Algorithm 1 on a batch of problems: greedy selection of ``k[p]`` units per problem.

    Parameters
    ----------
    feats:
        ``[P, M, Dk + Dv]`` features (keys then values) in the compute dtype; ``Dk == Dv`` whenever
        both halves are used (the seed adds them).
    key_dim:
        ``Dk``.
    valid:
        ``bool [P, M]`` selectable units (``valid.sum(-1) >= k``).
    k, k_max:
        ``long [P]`` units to select per problem and ``max(k)``.
    alpha, eta, lam, eps0, novelty:
        See :class:`CoRDSSelector`.

    Returns
    -------
    ``long [P, k_max]``: selected units in greedy order (seed first), ``-1`` after ``k[p]`` entries.

    Notes
    -----
    The seed is ``argmax_i ||k_i + v_i||`` (Algorithm 1); at the endpoints ``alpha = 1`` / ``alpha = 0``,
    where the distance sees only keys / only values, the seed is ``argmax ||k_i||`` / ``argmax ||v_i||``
    so that those endpoints are exactly K-only / V-only D^2 selection. The seed is the first of the
    ``k`` selected units (Algorithm 1's loop adds ``b`` more; we stop at ``b`` in total).
    Terms that cannot change the score are skipped (the values at ``alpha = 1`` when ``eta = 1`` or
    ``lam = 0``, the novelty state when ``lam = 0``); the result is the same.

    Structure: :func:`_setup` builds the state every step shares, then one step function per variant
    (:func:`_d2_step` when ``lam = 0``, else :func:`_max_cosine_step` or :func:`_exact_step`), chosen once,
    adds the last chosen unit and returns the next one.

    Raises
    ------
    ValueError
        ``novelty`` is not one of :data:`NOVELTY_VARIANTS`, or the exact novelty reads keys and values of
        different widths (``Dk != Dv``).
    """
    if novelty not in NOVELTY_VARIANTS:
        raise ValueError(f"novelty: must be one of {', '.join(NOVELTY_VARIANTS)}, got {novelty!r}")
    if k_max == 0:
        return torch.full((feats.shape[0], 0), -1, dtype=torch.long, device=feats.device)
    g = _setup(feats, key_dim, valid, alpha=alpha, eta=eta, lam=lam, eps0=eps0, novelty=novelty)
    step = _step_function(g, novelty, eta, k_max)  # chosen once for the whole run
    chosen = [_seed(g)]
    for t in range(k_max - 1):
        chosen.append(step(t, chosen[-1]))
    return mask_order(torch.stack(chosen, dim=1), k)


@register_selector("cords")
@dataclass(frozen=True)
class CoRDSSelector(Selector):
    """CoRDS: coreset selection in joint KV space with an orthogonal anti-redundancy bonus.

    Idea: keep the subset that best *covers* the cache. Greedy D^2-style farthest-first selection
    under the bicriteria distance ``d_alpha(i, S) = min_{j in S} alpha ||k_i - k_j||^2 + (1 - alpha)
    ||v_i - v_j||^2``, plus a bonus for candidates that add a new direction to the span of the kept keys
    and values. Each step picks ``argmax_i d~(i) + lam * Orth~(i)`` over the not-yet-selected candidates,
    ``~`` being min-max normalisation over that pool: ``(x - min) / (max - min + eps0)``. Seed:
    ``argmax ||k_i + v_i||``. Query-agnostic and training-free.

    Paper: "CoRDS" (this repository's ``paper/``), Algorithm 1, Eqs. ``dalpha``, ``orth-score``,
    ``final-score``; defaults from its implementation details.

    Parameters
    ----------
    alpha:
        Key/value weight of the bicriteria distance, in [0, 1]; 1 = keys only, 0 = values only.
        The paper's accuracy peaks at 0.1-0.25 (value-favouring); it is the one parameter worth tuning.
    eta:
        Key/value weight of the orthogonal novelty, in [0, 1].
    lam:
        Weight ``lambda`` of the orthogonal bonus, ``>= 0``; 0 = pure bicriteria D^2. The paper finds
        [0.1, 0.5] flat and 1 harmful.
    eps0:
        Regulariser of the min-max normalisation, ``> 0`` (numerical only).
    novelty:
        ``"max_cosine"`` (default): ``Orth(i) = eta (1 - max_{j in S} cos(k_i, k_j)) + (1 - eta)
        (1 - max_{j in S} cos(v_i, v_j))``, the surrogate the paper's implementation (and so its
        published accuracy) uses. ``"exact"``: ``Orth(i) = eta ||(I - P_S^K) k_i||^2 + (1 - eta)
        ||(I - P_S^V) v_i||^2`` as written in Algorithm 1, by incremental Gram-Schmidt. The surrogate is
        the default because it reproduces the paper's experiments and keeps discriminating when the
        budget exceeds the feature dimension: the exact residual is identically zero once the kept
        keys span the feature space (after ``H*D`` picks, i.e. for most of the greedy run at realistic
        budgets of thousands of tokens), after which ``exact`` degenerates to ``lam = 0``. Both cost
        one pass over the features per step.

    Notes
    -----
    Ties (scores within :func:`snap_tolerance` of the best) go to the lowest unit index. The paper
    also mentions ``beta = 0.15`` and a follower decay ``gamma`` without defining them; they are not
    exposed.
    """

    alpha: float = hyperparameter(0.25, low=0.0, high=1.0,
                                  help="key/value weight of the bicriteria distance (1 = keys only)")
    eta: float = hyperparameter(0.25, low=0.0, high=1.0, help="key/value weight of the orthogonal novelty")
    lam: float = hyperparameter(0.25, low=0.0, help="weight lambda of the orthogonal bonus (0 = pure D^2)")
    eps0: float = hyperparameter(1e-6, low=0.0, low_open=True, help="min-max normalisation regulariser")
    novelty: str = hyperparameter("max_cosine", choices=NOVELTY_VARIANTS,
                                  help="orthogonal novelty: paper's max-cosine surrogate or exact residual")

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        return cords_greedy(units.feats, units.key_dim, units.valid, units.k, units.k_max, alpha=self.alpha,
                            eta=self.eta, lam=self.lam, eps0=self.eps0, novelty=self.novelty)
