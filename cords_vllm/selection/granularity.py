"""Candidate ranks, groups of consecutive candidate tokens (frames, paged blocks), centroids, expansion.

All functions work on ``P`` problems at once with tensor ops only (no Python loop over tokens), and none reads
a tensor back to the host except the optional checks of :func:`labelled_group_ids` (one read).

Groups are defined over the *candidate* tokens of a problem, in token order: candidate number ``r``
(its rank, ``0`` = oldest) belongs to group ``r // group_size``. When the candidates of a request are a
block-aligned run of its paged cache, groups are exactly its KV blocks; when they are the tokens of a
video, groups are its frames (temporal patches). A group is represented by the centroid (mean) of its
tokens' key and value features, as in the paper's frame-level selection.
"""

from __future__ import annotations

import torch


def candidate_ranks(candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank of every candidate token among its problem's candidates.

    Parameters
    ----------
    candidates:
        ``bool [P, N]``.

    Returns
    -------
    rank:
        ``long [P, N]``: ``0..n-1`` over candidates in token order, ``-1`` for protected tokens.
    count:
        ``long [P]``: number of candidates ``n``.
    """
    csum = torch.cumsum(candidates.to(torch.long), dim=-1)
    rank = torch.where(candidates, csum - 1, -1)
    if candidates.shape[-1] == 0:
        return rank, torch.zeros(candidates.shape[0], dtype=torch.long, device=candidates.device)
    return rank, csum[:, -1]


def group_ids(rank: torch.Tensor, group_size: int) -> torch.Tensor:
    """``long [P, N]``: group of every candidate token (``rank // group_size``), ``-1`` for protected ones."""
    return torch.where(rank >= 0, torch.div(rank, group_size, rounding_mode="floor"), -1)


def labelled_group_ids(labels: torch.Tensor, candidates: torch.Tensor, group_size: int, *, check: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups given by labels: each run of candidates sharing a label (non-decreasing) is one group.

    Parameters
    ----------
    labels:
        ``long [P, N]`` group label of every token (e.g. frame number); read at candidates only.
    candidates:
        ``bool [P, N]``.
    group_size:
        Largest allowed group (candidates per label).
    check:
        Check the two preconditions below, with one host read (one synchronisation on a GPU). ``False`` for a
        caller whose labels guarantee them (the compress step: M-RoPE temporal positions never decrease along
        a request, and ``group_size`` is its largest frame): nothing is read back.

    Raises ``ValueError`` (naming ``group_index``), when ``check``, if labels decrease along the candidates or
    a group exceeds ``group_size``.

    Returns
    -------
    gid:
        ``long [P, N]``: ``0..G_p-1`` over the groups of each problem in token order, ``-1`` for
        protected tokens.
    count:
        ``long [P]``: number of groups ``G_p``.
    """
    low = torch.iinfo(torch.long).min
    seen = torch.cummax(torch.where(candidates, labels, low), dim=-1).values
    previous = torch.cat([torch.full_like(seen[:, :1], low), seen[:, :-1]], dim=-1)
    first = candidates & (labels != previous)
    csum = torch.cumsum(first.to(torch.long), dim=-1)
    gid = torch.where(candidates, csum - 1, -1)
    count = csum[:, -1] if labels.shape[-1] else torch.zeros(labels.shape[0], dtype=torch.long,
                                                             device=labels.device)
    if check and gid.numel():
        sizes = torch.zeros((labels.shape[0], labels.shape[1] + 1), dtype=torch.long, device=labels.device)
        sizes.scatter_add_(1, torch.where(gid >= 0, gid, labels.shape[1]), candidates.to(torch.long))
        decreasing = (candidates & (labels < seen)).any()
        decreasing, largest = torch.stack([decreasing.to(torch.long), sizes[:, :-1].max()]).tolist()  # one read
        if decreasing:
            raise ValueError("group_index: must be non-decreasing along each problem's candidate tokens")
        if largest > group_size:
            raise ValueError(f"group_index: a group has {largest} candidates, more than group_size={group_size}")
    return gid, count


def group_centroids(feats: torch.Tensor, gid: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Mean feature of every group.

    Parameters
    ----------
    feats:
        ``[P, N, F]`` token features.
    gid:
        ``long [P, N]`` group of each token, ``-1`` for tokens in no group.
    n_groups:
        ``G``, the number of group slots per problem (``>= max(gid) + 1``).

    Returns
    -------
    ``[P, G, F]`` centroids (zeros for empty slots).
    """
    p_count, _, f_dim = feats.shape
    # Flat slot p * G + g; tokens in no group go to a dump slot P * G that is dropped afterwards.
    base = torch.arange(p_count, device=feats.device)[:, None] * n_groups
    slot = torch.where(gid >= 0, base + gid, p_count * n_groups).reshape(-1)
    sums = torch.zeros((p_count * n_groups + 1, f_dim), dtype=feats.dtype, device=feats.device)
    sums.index_add_(0, slot, feats.reshape(-1, f_dim))
    counts = torch.zeros(p_count * n_groups + 1, dtype=feats.dtype, device=feats.device)
    counts.index_add_(0, slot, torch.ones_like(slot, dtype=feats.dtype))
    cent = sums[:-1] / counts[:-1].clamp_min(1)[:, None]
    return cent.view(p_count, n_groups, f_dim)


def units_to_mask(order: torch.Tensor, n_units: int) -> torch.Tensor:
    """``bool [P, M]`` mask of the units listed in ``order`` (``long [P, k]``, ``-1`` = padding)."""
    p_count = order.shape[0]
    mask = torch.zeros((p_count, n_units + 1), dtype=torch.bool, device=order.device)
    mask.scatter_(1, torch.where(order >= 0, order, n_units), True)
    return mask[:, :n_units]


def expand_group_selection(chosen_groups: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """``bool [P, N]``: tokens whose group is chosen (``chosen_groups`` is ``bool [P, G]``)."""
    if chosen_groups.shape[1] == 0:
        return torch.zeros_like(gid, dtype=torch.bool)
    picked = torch.gather(chosen_groups, 1, gid.clamp_min(0))
    return picked & (gid >= 0)
