"""What a selection returns (:class:`SelectionResult`) and how many tokens it keeps (the exact-count contract).

Contract (what the engine relies on): for a problem with ``n`` candidate tokens and ``p`` protected
tokens, the number of kept tokens is ``p + n`` when ``budget >= n``; otherwise ``p + budget`` at token
granularity and ``p + group_size * (budget // group_size)`` at frame/block granularity. It depends only
on ``n``, ``p``, ``budget`` and ``group_size``, never on the features (:func:`kept_candidate_count`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectionResult:
    """What a selector kept.

    Attributes
    ----------
    keep:
        ``bool [B, N]`` (joint scope) or ``[B, H, N]`` (``per_head=True``): True for every protected
        token and every kept candidate.
    order:
        ``long [B, k_max]`` or ``[B, H, k_max]``: the units chosen, in the order the policy chose them
        (CoRDS: greedy order, seed first; score-based policies: best first; rule-based policies: by
        rank). Units are token indices into ``N`` at token granularity and group indices (``0`` = the
        oldest group of candidate tokens) at frame/block granularity. Rows are padded with ``-1``;
        a problem whose budget covers all its candidates keeps everything without running the policy
        and has an all ``-1`` row.
    granularity:
        ``"token"``, ``"frame"`` or ``"block"``.
    group_size:
        Tokens per group (``None`` at token granularity unless given).
    per_head:
        Whether each KV head was selected on its own.
    """

    keep: torch.Tensor
    order: torch.Tensor
    granularity: str
    group_size: int | None
    per_head: bool

    @property
    def num_kept(self) -> torch.Tensor:
        """``long [B]`` or ``[B, H]``: kept tokens per problem (protected tokens included)."""
        return self.keep.sum(-1)

    def kept_indices(self) -> torch.Tensor:
        """Sorted kept token indices, ``long [B, n_keep]`` or ``[B, H, n_keep]``.

        Raises ``ValueError`` if problems keep different numbers of tokens (then the result is not
        rectangular; give every problem the same candidate and protected counts).
        """
        counts = self.num_kept
        if counts.numel() == 0:
            return torch.zeros((*self.keep.shape[:-1], 0), dtype=torch.long, device=self.keep.device)
        n_keep = int(counts.max())
        if int(counts.min()) != n_keep:
            raise ValueError(
                "kept_indices: problems keep different numbers of tokens "
                f"(min {int(counts.min())}, max {n_keep}); the result is not rectangular")
        # A stable sort of (not kept) puts kept positions first, in increasing index order.
        dropped = (~self.keep).to(torch.uint8)
        return torch.sort(dropped, dim=-1, stable=True).indices[..., :n_keep]

    def evicted(self) -> torch.Tensor:
        """``bool`` mask of evicted tokens (``~keep``), same shape as ``keep``."""
        return ~self.keep


def kept_candidate_count(n_candidates: int, budget: int, granularity: str, group_size: int | None) -> int:
    """How many candidate tokens a problem keeps (the exact-count contract, see the module docstring).

    Raises ``ValueError`` when the budget does not cover the candidates at frame/block granularity and
    ``group_size`` is ``None`` (the count then depends on the group size).
    """
    if budget >= n_candidates:
        return n_candidates
    if granularity == "token":
        return budget
    if group_size is None:
        raise ValueError(f"group_size: required (tokens per {granularity}) at {granularity} granularity")
    return group_size * (budget // group_size)
