"""Brute-force reference implementations, written for obviousness, not speed.

``brute_force_select`` transcribes Algorithm 1 of the CoRDS paper literally: for every problem (Python
loops over problems, groups and candidates), every greedy step recomputes every bicriteria distance to
every selected point and the exact orthogonal projector ``P_S = U pinv(U)`` (or every cosine) from
scratch. It shares nothing with the fast implementation except the documented numerical conventions:
the snapping tolerance, the seed rule at ``alpha`` in ``{0, 1}`` and the tie rule (lowest index among
the scores within the tolerance of the best).
"""

from __future__ import annotations

import torch

from cords_vllm.selection.cords import snap_tolerance


def _first_near_max(values: list[float], slack: float) -> int:
    """Lowest index whose value is within ``slack`` of the maximum (the library's tie rule)."""
    best = max(values)
    for i, x in enumerate(values):
        if x >= best - slack:
            return i
    raise AssertionError("unreachable")


def seed_features(keys: torch.Tensor, values: torch.Tensor, alpha: float) -> torch.Tensor:
    """What the seed maximises the norm of: ``k + v``, or keys / values alone at alpha = 1 / 0."""
    if alpha == 1.0:
        return keys
    if alpha == 0.0:
        return values
    return keys + values


def _cos(x: torch.Tensor, y: torch.Tensor) -> float:
    nx, ny = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    if nx == 0.0 or ny == 0.0:
        return 0.0
    return float(x @ y) / (nx * ny)


def brute_force_cords_units(
    keys: torch.Tensor,
    values: torch.Tensor,
    b: int,
    *,
    alpha: float,
    eta: float,
    lam: float,
    eps0: float,
    novelty: str,
    space: str = "paper",
) -> list[int]:
    """Algorithm 1 on one problem: ``keys [n, Dk]``, ``values [n, Dv]``; returns ``b`` indices in order.

    ``space="normalized"``: the keys, and the values, are first divided by the square root of their mean squared
    distance to their mean over the problem's ``n`` units (a space with no spread is left as it is)."""
    n = keys.shape[0]
    tol = snap_tolerance(keys.dtype)
    if b == 0:
        return []
    if space == "normalized":
        def spread(x: torch.Tensor) -> float:
            mean = sum(x[i] for i in range(n)) / n
            return (sum(float((x[i] - mean) @ (x[i] - mean)) for i in range(n)) / n) ** 0.5
        keys = keys / (spread(keys) or 1.0)
        values = values / (spread(values) or 1.0)

    # Seed: argmax ||k_i + v_i|| (keys / values only at the alpha endpoints).
    seed_feat = seed_features(keys, values, alpha)
    norms = [float(torch.linalg.vector_norm(seed_feat[i])) for i in range(n)]
    selected = [_first_near_max(norms, tol * max(norms))]

    def d_alpha(i: int, j: int) -> float:
        dk = float(((keys[i] - keys[j]) ** 2).sum())
        dv = float(((values[i] - values[j]) ** 2).sum())
        d = alpha * dk + (1 - alpha) * dv
        base_i = alpha * float(keys[i] @ keys[i]) + (1 - alpha) * float(values[i] @ values[i])
        base_j = alpha * float(keys[j] @ keys[j]) + (1 - alpha) * float(values[j] @ values[j])
        return 0.0 if d <= tol * (base_i + base_j) else d

    def projector(span: torch.Tensor) -> torch.Tensor:
        # span: [D, t]; the exact orthogonal projector onto its columns, P = U (U^T U)^+ U^T = U U^+.
        return span @ torch.linalg.pinv(span)

    def residual(x: torch.Tensor, proj: torch.Tensor) -> float:
        r = x - proj @ x
        r2 = float(r @ r)
        return 0.0 if r2 <= tol * float(x @ x) else r2

    def cos_novelty(x: torch.Tensor, chosen: torch.Tensor) -> float:
        cosines = [_cos(x, chosen[j]) for j in range(chosen.shape[0])]
        return 1.0 - max(1.0 if c >= 1.0 - tol else c for c in cosines)

    while len(selected) < b:
        pool = [i for i in range(n) if i not in selected]
        if novelty == "exact":  # recomputed from scratch at every step
            proj_k, proj_v = projector(keys[selected].T), projector(values[selected].T)
        d = []
        orth = []
        for i in pool:
            d.append(min(d_alpha(i, j) for j in selected))
            if novelty == "exact":
                nk = residual(keys[i], proj_k)
                nv = residual(values[i], proj_v)
            else:
                nk = cos_novelty(keys[i], keys[selected])
                nv = cos_novelty(values[i], values[selected])
            orth.append(eta * nk + (1 - eta) * nv)

        def minmax(x: list[float]) -> list[float]:
            lo, hi = min(x), max(x)
            return [(v - lo) / (hi - lo + eps0) for v in x]

        score = [a + lam * o for a, o in zip(minmax(d), minmax(orth), strict=True)]
        selected.append(pool[_first_near_max(score, tol)])
    return selected


def _problem_features(keys: torch.Tensor, values: torch.Tensor, b: int, h: int | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of one problem, ``[N, D]`` for one head or ``[N, H*D]`` with all heads concatenated."""
    if h is not None:
        return keys[b, h], values[b, h]
    _, heads, n, d = keys.shape
    return (keys[b].permute(1, 0, 2).reshape(n, heads * d), values[b].permute(1, 0, 2).reshape(n, heads * d))


def brute_force_select(
    keys: torch.Tensor,
    values: torch.Tensor,
    budget: int,
    *,
    candidates: torch.Tensor | None = None,
    granularity: str = "token",
    group_size: int | None = None,
    per_head: bool = False,
    alpha: float = 0.25,
    eta: float = 0.25,
    lam: float = 0.25,
    eps0: float = 1e-6,
    novelty: str = "max_cosine",
    space: str = "paper",
) -> tuple[torch.Tensor, list[list[int]]]:
    """Reference CoRDS selection for ``[B, H, N, D]`` inputs.

    Returns the keep mask (``[B, N]`` or ``[B, H, N]``) and, per problem (row-major over ``B`` then
    ``H``), the list of selected units in greedy order (token indices or group indices).
    """
    bsz, heads, n_tok, _ = keys.shape
    keys = keys.to(torch.float64) if keys.dtype == torch.float64 else keys.to(torch.float32)
    values = values.to(keys.dtype)
    if candidates is None:
        candidates = torch.ones((bsz, n_tok), dtype=torch.bool)
    keep = torch.zeros((bsz, heads, n_tok) if per_head else (bsz, n_tok), dtype=torch.bool)
    orders: list[list[int]] = []
    for b in range(bsz):
        for h in (range(heads) if per_head else [None]):
            k_all, v_all = _problem_features(keys, values, b, h)
            cand = [i for i in range(n_tok) if bool(candidates[b, i])]
            row = keep[b, h] if h is not None else keep[b]
            for i in range(n_tok):
                if i not in cand:
                    row[i] = True
            if budget >= len(cand):
                for i in cand:
                    row[i] = True
                orders.append([])
                continue
            params = dict(alpha=alpha, eta=eta, lam=lam, eps0=eps0, novelty=novelty, space=space)
            if granularity == "token":
                sel = brute_force_cords_units(k_all[cand], v_all[cand], budget, **params)
                tokens = [cand[u] for u in sel]
                for i in tokens:
                    row[i] = True
                orders.append(tokens)
            else:
                assert group_size is not None
                groups = [cand[g * group_size:(g + 1) * group_size] for g in range(len(cand) // group_size)]
                ck = torch.stack([k_all[g].mean(0) for g in groups]) if groups else k_all[:0]
                cv = torch.stack([v_all[g].mean(0) for g in groups]) if groups else v_all[:0]
                sel = brute_force_cords_units(ck, cv, budget // group_size, **params)
                for g in sel:
                    for i in groups[g]:
                        row[i] = True
                orders.append(sel)
    return keep, orders


def order_rows(order: torch.Tensor) -> list[list[int]]:
    """A result's ``order`` (``[B, k]`` or ``[B, H, k]``) as per-problem lists without the ``-1`` padding."""
    n_rows = 1
    for size in order.shape[:-1]:
        n_rows *= int(size)
    if order.shape[-1] == 0:
        return [[] for _ in range(n_rows)]
    flat = order.reshape(n_rows, order.shape[-1])
    return [[int(x) for x in row if int(x) >= 0] for row in flat]
