"""Coverage of the full cache by the kept tokens: the CDF of nearest-kept cosine distance (paper Fig. 5).

For every token of the full cache, the cosine distance ``1 - cos`` to its nearest kept token; the CDF of
these distances over the evaluated tokens is the coverage curve. Curves further left (higher CDF at
small distances) mean the kept set represents the cache better. Three feature spaces, so that a
selector is not judged only by the metric it optimises:

* ``"joint"``: ``[k / ||k||; v / ||v||] / sqrt(2)`` (each component normalised), whose cosine is the
  mean of the key cosine and the value cosine;
* ``"k"``: keys only; ``"v"``: values only.

Scope: with a ``[B, N]`` keep mask the features are the keys (values) of all KV heads concatenated; with
a ``[B, H, N]`` mask (or ``per_head=True``) every head is its own problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cords_vllm.lab.fidelity.neighbours import nearest_kept
from cords_vllm.selection.base import compute_dtype

SPACES: tuple[str, ...] = ("joint", "k", "v")


@dataclass(frozen=True)
class CoverageCDF:
    """An empirical CDF on a fixed grid.

    Attributes
    ----------
    grid:
        ``[G]`` increasing cosine distances.
    cdf:
        ``[G]``: fraction of evaluated tokens whose nearest-kept distance is ``<= grid[g]``.
    """

    grid: torch.Tensor
    cdf: torch.Tensor


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-30)


def nearest_kept_cosine_distance(
    keys: torch.Tensor,
    values: torch.Tensor,
    keep: torch.Tensor,
    *,
    space: str = "joint",
    per_head: bool | None = None,
) -> torch.Tensor:
    """Cosine distance of every token to its nearest kept token.

    Parameters
    ----------
    keys, values:
        ``[B, H, N, D]``.
    keep:
        ``bool [B, N]`` or ``[B, H, N]``.
    space:
        ``"joint"``, ``"k"`` or ``"v"``.
    per_head:
        Evaluate each head on its own; default: True iff ``keep`` is ``[B, H, N]``.

    Returns
    -------
    ``[B, N]`` (heads jointly) or ``[B, H, N]`` distances in ``[0, 2]``; 0 for kept tokens.
    """
    if space not in SPACES:
        raise ValueError(f"space: must be one of {', '.join(SPACES)}, got {space!r}")
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"keys/values: expected two [B, H, N, D] tensors of one shape, got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    b, h, n, d = keys.shape
    if keep.dtype != torch.bool or tuple(keep.shape) not in ((b, n), (b, h, n)):
        raise ValueError(f"keep: expected a bool tensor [B, N] or [B, H, N], got {tuple(keep.shape)}")
    if per_head is None:
        per_head = keep.dim() == 3
    if keep.dim() == 3 and not per_head:
        raise ValueError("per_head: a [B, H, N] keep mask needs per_head=True")
    dt = compute_dtype(keys.dtype)
    k, v = keys.to(dt), values.to(dt)
    if per_head:
        kf, vf = k.reshape(b * h, n, d), v.reshape(b * h, n, d)
        mask = keep if keep.dim() == 3 else keep[:, None, :].expand(b, h, n)
        mask = mask.reshape(b * h, n)
    else:
        kf = k.permute(0, 2, 1, 3).reshape(b, n, h * d)
        vf = v.permute(0, 2, 1, 3).reshape(b, n, h * d)
        mask = keep
    if space == "joint":
        feats = torch.cat([_unit(kf), _unit(vf)], dim=-1) / (2.0 ** 0.5)
    elif space == "k":
        feats = _unit(kf)
    else:
        feats = _unit(vf)
    _, sim = nearest_kept(feats, mask, metric="cosine")
    dist = (1.0 - sim).clamp(0.0, 2.0)
    dist = torch.where(mask, 0.0, dist)
    return dist.view(b, h, n) if per_head else dist


def coverage_cdf(
    distances: torch.Tensor,
    tokens: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
) -> CoverageCDF:
    """Empirical CDF of ``distances`` (any shape) over the entries selected by ``tokens``.

    Parameters
    ----------
    distances:
        Nearest-kept distances, e.g. from :func:`nearest_kept_cosine_distance`.
    tokens:
        Optional bool mask broadcastable to ``distances``: which tokens to evaluate (for example only
        the candidates, leaving out protected tokens that are trivially covered).
    grid:
        ``[G]`` evaluation points; default 401 points on ``[0, 2]``.
    """
    if grid is None:
        grid = torch.linspace(0.0, 2.0, 401, dtype=torch.float64)
    x = distances.to(torch.float64)
    if tokens is not None:
        x = x[tokens.expand_as(distances)]
    x = torch.sort(x.reshape(-1)).values.cpu()
    g = grid.to(torch.float64).cpu()
    if x.numel() == 0:
        return CoverageCDF(grid=g, cdf=torch.zeros_like(g))
    below = torch.searchsorted(x, g, right=True)
    return CoverageCDF(grid=g, cdf=below.to(torch.float64) / x.numel())


def coverage_curves(
    keys: torch.Tensor,
    values: torch.Tensor,
    keep: torch.Tensor,
    *,
    tokens: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
    per_head: bool | None = None,
    spaces: Sequence[str] = SPACES,
) -> dict[str, CoverageCDF]:
    """Coverage CDFs of one kept set in each feature space (``{"joint": ..., "k": ..., "v": ...}``).

    ``tokens`` (``bool [B, N]``) restricts the evaluated tokens; see :func:`coverage_cdf`.
    """
    out = {}
    for space in spaces:
        dist = nearest_kept_cosine_distance(keys, values, keep, space=space, per_head=per_head)
        mask = None
        if tokens is not None:
            mask = tokens[:, None, :] if dist.dim() == 3 else tokens
        out[space] = coverage_cdf(dist, mask, grid)
    return out


def max_cdf_gap(a: CoverageCDF, b: CoverageCDF) -> tuple[float, float]:
    """``max_d (CDF_a(d) - CDF_b(d))`` and the distance ``d`` where it occurs (the paper's Delta)."""
    if not torch.equal(a.grid, b.grid):
        raise ValueError("b: the two CDFs must share one grid")
    diff = a.cdf - b.cdf
    i = int(torch.argmax(diff))
    return float(diff[i]), float(a.grid[i])


def dominates(a: CoverageCDF, b: CoverageCDF, *, atol: float = 0.0) -> bool:
    """True if ``a`` covers at least as well as ``b`` everywhere: ``CDF_a >= CDF_b - atol`` on the grid."""
    if not torch.equal(a.grid, b.grid):
        raise ValueError("b: the two CDFs must share one grid")
    return bool((a.cdf >= b.cdf - atol).all())
