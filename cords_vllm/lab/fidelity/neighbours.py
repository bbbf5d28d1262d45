"""Nearest kept token of every token, chunked so that no ``N x N`` matrix is formed."""

from __future__ import annotations

from typing import Literal

import torch

Metric = Literal["sqeuclidean", "cosine"]


def kept_index_table(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept token indices of every problem, padded to a rectangle.

    Parameters
    ----------
    keep:
        ``bool [P, N]``.

    Returns
    -------
    index:
        ``long [P, K]`` kept indices in increasing order (``K`` = max kept count), padded with 0.
    present:
        ``bool [P, K]``: which entries are real.
    """
    counts = keep.sum(-1)
    k_max = int(counts.max()) if counts.numel() else 0
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[:, :k_max]
    present = torch.arange(k_max, device=keep.device)[None, :] < counts[:, None]
    return torch.where(present, order, 0), present


def nearest_kept(
    feats: torch.Tensor,
    keep: torch.Tensor,
    *,
    metric: Metric = "sqeuclidean",
    chunk_elems: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token, its nearest kept token.

    Parameters
    ----------
    feats:
        ``[P, N, F]`` features (for ``"cosine"``, already normalised to unit norm or zero).
    keep:
        ``bool [P, N]``; every problem must keep at least one token.
    metric:
        ``"sqeuclidean"``: minimise ``||x_i - x_j||^2``; ``"cosine"``: maximise ``x_i . x_j``.
    chunk_elems:
        Upper bound on the elements of one ``[P, rows, K]`` similarity block.

    Returns
    -------
    index:
        ``long [P, N]``: nearest kept token (a kept token is its own nearest; ties: lowest index).
    value:
        ``[P, N]``: the squared distance (``0`` for kept tokens) or the dot product (``1`` for kept
        tokens with unit features).
    """
    p_count, n_tok, _ = feats.shape
    if p_count and n_tok and not bool(keep.any(-1).all()):
        raise ValueError("keep: every problem must keep at least one token")
    kidx, present = kept_index_table(keep)
    k_max = kidx.shape[1]
    kept = torch.gather(feats, 1, kidx.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))  # [P, K, F]
    index = torch.empty((p_count, n_tok), dtype=torch.long, device=feats.device)
    value = torch.empty((p_count, n_tok), dtype=feats.dtype, device=feats.device)
    rows = max(1, chunk_elems // max(1, p_count * k_max))
    kept_sq = (kept * kept).sum(-1) if metric == "sqeuclidean" else None
    for start in range(0, n_tok, rows):
        x = feats[:, start:start + rows]
        dots = torch.bmm(x, kept.transpose(1, 2))  # [P, r, K]
        if metric == "sqeuclidean":
            assert kept_sq is not None
            d = ((x * x).sum(-1, keepdim=True) + kept_sq[:, None, :] - 2.0 * dots).clamp_min(0.0)
            d = d.masked_fill(~present[:, None, :], float("inf"))
            val, arg = d.min(-1)
        else:
            s = dots.masked_fill(~present[:, None, :], float("-inf"))
            val, arg = s.max(-1)
        index[:, start:start + rows] = torch.gather(kidx, 1, arg)
        value[:, start:start + rows] = val
    # Kept tokens map to themselves, exactly.
    self_idx = torch.arange(n_tok, device=feats.device).expand(p_count, n_tok)
    index = torch.where(keep, self_idx, index)
    if metric == "sqeuclidean":
        value = torch.where(keep, 0.0, value)
    else:
        self_dot = (feats * feats).sum(-1)
        value = torch.where(keep, self_dot, value)
    return index, value
