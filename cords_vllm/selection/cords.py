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

from dataclasses import dataclass

import torch

from cords_vllm.selection.base import Selector, UnitBatch, hyperparameter
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
    return torch.where(norm > 0, 1.0 / torch.where(norm > 0, norm, 1.0), 0.0)


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
    """
    p_count, m_units, _ = feats.shape
    device, dtype = feats.device, feats.dtype
    if k_max == 0:
        return torch.full((p_count, 0), -1, dtype=torch.long, device=device)
    tol = snap_tolerance(dtype)
    exact = novelty == "exact"

    # 0-dim tensors for the constants of the loop: a Python scalar in a binary op costs a conversion
    # each time, which adds up over thousands of small per-step ops.
    def const(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=dtype, device=device)

    c_zero, c_one, c_tol, c_eps0 = const(0.0), const(1.0), const(tol), const(eps0)
    c_snap_cos = const(1.0 - tol)
    c_eta, c_eta_v = const(eta), const(1.0 - eta)

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
    keys, vals = x_all[..., :dk], x_all[..., dk:]
    ar = torch.arange(p_count, device=device)
    zeros = torch.zeros((p_count, m_units), dtype=dtype, device=device)
    kn = torch.linalg.vector_norm(keys, dim=-1) if need_k else zeros
    vn = torch.linalg.vector_norm(vals, dim=-1) if need_v else zeros
    kn2, vn2 = kn * kn, vn * vn

    # Per-unit constants, gathered for the new point in one index op: base, |k|, |v|, 1/|k|, 1/|v|.
    base = (alpha * kn2 if use_kd else zeros) + ((1.0 - alpha) * vn2 if use_vd else zeros)
    inv_kn, inv_vn = _inverse_norm(kn), _inverse_norm(vn)
    aux = torch.stack([base, kn, vn, inv_kn, inv_vn], dim=-1)  # [P, M, 5], gathered once per step

    # Columns of the per-step matmul (few columns: a skinny GEMM runs at memory speed). With the
    # max-cosine surrogate the plain dots k.k_j and v.v_j serve both the distance and the cosines;
    # otherwise one combined column -2 (alpha k.k_j + (1 - alpha) v.v_j), plus the new directions.
    split = use_orth and not exact
    wanted_cols = (("kdot", split and need_k), ("vdot", split and need_v), ("dist", not split),
                   ("kq", use_ko and exact), ("vq", use_vo and exact))
    cols = {name: i for i, name in enumerate(n for n, wanted in wanted_cols if wanted)}
    w = torch.zeros((p_count, _padded_columns(len(cols)), f_dim), dtype=dtype, device=device)
    dist_scale = torch.cat([torch.full((dk,), -2.0 * alpha, dtype=dtype, device=device),
                            torch.full((f_dim - dk,), -2.0 * (1.0 - alpha), dtype=dtype, device=device)])

    # State rows: 0 = min distance d_alpha(i, S); 1 = orthogonal novelty Orth(i | S) (when lam > 0).
    state = torch.zeros((p_count, 2 if use_orth else 1, m_units), dtype=dtype, device=device)
    min_dist = state[:, 0]
    min_dist.fill_(float("inf"))
    live = exact and use_orth
    if live:
        # Exact novelty: the key and value components are stacked ([P, C, ...], C = 1 or 2) so that
        # their Gram-Schmidt steps and residual updates run as one batch.
        comps = [c for c, used in ((0, use_ko), (1, use_vo)) if used]  # 0 = keys, 1 = values
        n_c = len(comps)
        comp_dim = dk if comps == [0] else f_dim - dk
        if n_c == 2 and dk != comp_dim:
            raise ValueError("feats: exact novelty on keys and values needs Dk == Dv")
        offsets = [0 if c == 0 else dk for c in comps]  # where each component sits in a feature row
        q_col = cols["kq"] if use_ko else cols["vq"]  # first of the n_c consecutive direction columns
        basis = torch.zeros((p_count * n_c, k_max, comp_dim), dtype=dtype, device=device)
        norms2 = torch.stack([(kn2, vn2)[c] for c in comps], dim=1)  # [P, C, M]
        res_thr = tol * norms2
        res = norms2.masked_fill(norms2 <= res_thr, 0.0)  # squared residuals ||(I - P_S) x_i||^2
        eta_w = torch.tensor([(eta, 1.0 - eta)[c] for c in comps], dtype=dtype, device=device).view(1, n_c, 1)
    else:
        nov_k = torch.full((p_count, m_units), 2.0, dtype=dtype, device=device) if use_ko else None
        nov_v = torch.full((p_count, m_units), 2.0, dtype=dtype, device=device) if use_vo else None
    out_of_pool = ~valid
    out_of_pool_rows = out_of_pool.unsqueeze(1)

    # Seed.
    both = use_kd and use_vd
    seed_score = torch.linalg.vector_norm(keys + vals, dim=-1) if both else (kn if use_kd else vn)
    seed_best = seed_score.masked_fill(out_of_pool, float("-inf")).amax(-1, keepdim=True)
    j = _first_near_max(seed_score, out_of_pool, tol * seed_best.clamp_min(0.0))

    chosen = [j]
    for t in range(k_max - 1):
        out_of_pool.scatter_(1, j.unsqueeze(-1), True)

        # --- incremental update with the new point j: one pass over the features ---------------
        x = x_all[ar, j]  # [P, F]
        aux_j = aux[ar, j]  # [P, 5]: base_j, |k_j|, |v_j|, 1/|k_j|, 1/|v_j|
        if "dist" in cols:
            torch.mul(x, dist_scale, out=w[:, cols["dist"]])
        if "kdot" in cols:  # k_j / |k_j|: the column yields |k_i| cos(k_i, k_j)
            torch.mul(x[:, :dk], aux_j[:, 3:4], out=w[:, cols["kdot"], :dk])
        if "vdot" in cols:
            torch.mul(x[:, dk:], aux_j[:, 4:5], out=w[:, cols["vdot"], dk:])
        if live:
            # [P * C, dim]: rows (problem, component); with both components a view of x = [k_j; v_j].
            xc = x.view(p_count * 2, comp_dim) if n_c == 2 else x[:, offsets[0]:offsets[0] + comp_dim]
            q = _new_direction(basis, t, xc, (res[ar, :, j] > c_zero).reshape(-1))
            basis[:, t] = q
            q = q.view(p_count, n_c, comp_dim)
            for i, off in enumerate(offsets):
                w[:, q_col + i, off:off + comp_dim] = q[:, i]
        prod = torch.bmm(x_all, w.transpose(1, 2))  # [P, M, C]: the one pass over the features

        base_sum = base + aux_j[:, 0:1]  # base_i + base_j
        if "dist" in cols:
            dist = torch.add(base_sum, prod[..., cols["dist"]])
        else:  # k_i.k_j = |k_j| * (column kdot), likewise for values
            dist = base_sum
            if use_kd:
                dist = torch.addcmul(dist, prod[..., cols["kdot"]], aux_j[:, 1:2], value=-2.0 * alpha)
            if use_vd:
                dist = torch.addcmul(dist, prod[..., cols["vdot"]], aux_j[:, 2:3], value=-2.0 * (1.0 - alpha))
        dist = dist.clamp_min(0.0)
        dist.masked_fill_(dist <= base_sum.mul_(c_tol), 0.0)
        torch.minimum(min_dist, dist, out=min_dist)

        if use_orth:
            orth = state[:, 1]
            if exact:
                if live:
                    proj = prod[..., q_col:q_col + n_c].transpose(1, 2)  # [P, C, M]
                    res.addcmul_(proj, proj, value=-1.0).clamp_min_(0.0)
                    res.masked_fill_(res <= res_thr, 0.0)
                    # Residuals never grow: once they are all zero (the spans are the whole feature
                    # space, after at least dim picks) they stay zero; drop the direction columns.
                    if t + 1 >= comp_dim and not bool(res.any()):
                        live = False
                        names = [name for name in cols if name not in ("kq", "vq")]
                        pad = w.new_zeros(p_count, _padded_columns(len(names)) - len(names), f_dim)
                        w = torch.cat([w[:, [cols[name] for name in names]], pad], 1)
                        cols = {name: i for i, name in enumerate(names)}
                torch.sum(res * eta_w, dim=1, out=orth)
            else:
                for name, inv, nov in (("kdot", inv_kn, nov_k), ("vdot", inv_vn, nov_v)):
                    if nov is None:
                        continue
                    cos = prod[..., cols[name]] * inv
                    cos.masked_fill_(cos >= c_snap_cos, 1.0)
                    torch.minimum(nov, c_one - cos, out=nov)
                if nov_k is not None and nov_v is not None:
                    torch.mul(nov_k, c_eta, out=orth)
                    orth.add_(nov_v, alpha=1.0 - eta)
                elif nov_k is not None:
                    torch.mul(nov_k, c_eta, out=orth)
                else:
                    torch.mul(nov_v, c_eta_v, out=orth)

        # --- min-max over the pool, score, next point --------------------------------------------
        lo = state.masked_fill(out_of_pool_rows, float("inf")).amin(-1, keepdim=True)
        hi = state.masked_fill(out_of_pool_rows, float("-inf")).amax(-1, keepdim=True)
        normed = (state - lo) / (hi - lo + c_eps0)
        score = torch.add(normed[:, 0], normed[:, 1], alpha=lam) if use_orth else normed[:, 0]
        j = _first_near_max(score, out_of_pool, c_tol)
        chosen.append(j)
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
