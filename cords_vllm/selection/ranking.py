"""Batched top-k with a per-problem ``k`` and the library's tie rule.

Tie rule (every policy): among units with exactly equal scores the one with the lowest unit index wins
(a stable sort; ``torch.argmax`` returns the first maximum for the same reason).
"""

from __future__ import annotations

import torch


def top_k_order(
    scores: torch.Tensor,
    valid: torch.Tensor,
    k: torch.Tensor,
    k_max: int,
    *,
    descending: bool = True,
) -> torch.Tensor:
    """The ``k[p]`` best valid units of every problem, best first.

    Parameters
    ----------
    scores:
        ``[P, M]`` finite scores.
    valid:
        ``bool [P, M]``: units that may be chosen (``valid.sum(-1) >= k``).
    k:
        ``long [P]`` units to choose per problem.
    k_max:
        ``max(k)``: width of the returned order.
    descending:
        True: highest scores first; False: lowest first.

    Returns
    -------
    ``long [P, k_max]``: unit indices, ``-1`` after the first ``k[p]`` entries of row ``p``.
    """
    fill = float("-inf") if descending else float("inf")
    masked = scores.masked_fill(~valid, fill)
    idx = torch.sort(masked, dim=-1, descending=descending, stable=True).indices[:, :k_max]
    return mask_order(idx, k)


def mask_order(order: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Replace entries ``t >= k[p]`` of ``order`` (``long [P, T]``) with ``-1``."""
    t = torch.arange(order.shape[1], device=order.device)
    return torch.where(t[None, :] < k[:, None], order, -1)
