"""Observation queries: what attention-scored policies (SnapKV, StreamMem) read besides keys and values.

A query-agnostic policy such as CoRDS needs only the cache. The attention-scored baselines score each cached
token by how much attention a set of *observation queries* gives it: SnapKV's window of the newest tokens'
queries, StreamMem's chat-template tokens. :class:`Observation` carries those queries to
:meth:`~cords_vllm.selection.base.Selector.select`; :func:`observed_attention` turns them into one score per
token and KV head. The engine captures the queries while it prefills (rotary already applied, exactly as the
attention kernel saw them), so the scores are the attention the model computed, restricted to the keys the
selection reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Observation:
    """The observation queries of ``B`` selection problems.

    Attributes
    ----------
    queries:
        ``[B, Hq, W, D]``: ``W`` query rows of ``Hq`` query heads, ``Hq`` a multiple of the ``H`` KV heads (grouped
        query attention: query head ``q`` reads KV head ``q // (Hq / H)``), head dim ``D`` as the keys'.
    visible:
        ``bool [B, W, N]``, optional: whether query row ``w`` may attend to token ``n`` (causality, rows not
        captured yet). A row that sees no token contributes nothing. ``None``: every row sees every token.
    """

    queries: torch.Tensor
    visible: torch.Tensor | None = None

    def check(self, keys: torch.Tensor) -> None:
        """``ValueError`` (naming ``observation``) unless the queries fit ``keys`` (``[B, H, N, D]``)."""
        b, h, n, d = keys.shape
        q = self.queries
        if q.dim() != 4 or q.shape[0] != b or q.shape[3] != d or q.shape[1] % h:
            raise ValueError(f"observation: queries must be [B={b}, Hq, W, D={d}] with Hq a multiple of the {h} KV "
                             f"heads, got {tuple(q.shape)}")
        if not q.is_floating_point() or q.device != keys.device:
            raise ValueError(f"observation: queries must be floating point on {keys.device}, got {q.dtype} on "
                             f"{q.device}")
        if self.visible is not None and (self.visible.shape != (b, q.shape[2], n) or self.visible.dtype != torch.bool
                                         or self.visible.device != keys.device):
            raise ValueError(f"observation: visible must be bool [{b}, {q.shape[2]}, {n}] on {keys.device}, got "
                             f"{self.visible.dtype} {tuple(self.visible.shape)}")


def observed_attention(keys: torch.Tensor, observation: Observation, dtype: torch.dtype) -> torch.Tensor:
    """Mean attention weight each token receives from the observation's query rows, per KV head.

    Each query row attends over the ``N`` tokens it sees with softmax(q . k / sqrt(D)) (the model's own scale), so
    its weights sum to 1; the score of a token is the mean of its weights over the rows that see any token and
    over the query heads of its KV head's group.

    Parameters
    ----------
    keys:
        ``[B, H, N, D]``.
    observation:
        Checked against ``keys`` (:meth:`Observation.check`).
    dtype:
        The compute dtype.

    Returns
    -------
    ``[B, H, N]`` in ``dtype``, each in [0, 1]; all zero for a problem none of whose rows sees a token.
    """
    b, h, _, d = keys.shape
    q = observation.queries.to(dtype)
    w = q.shape[2]
    group = q.shape[1] // h
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q.reshape(b, h, group, w, d), keys.to(dtype)) / math.sqrt(d)
    if observation.visible is not None:
        seen = observation.visible[:, None, None]  # [B, 1, 1, W, N]
        logits = logits.masked_fill(~seen, float("-inf"))
        rows = observation.visible.any(-1)  # [B, W]
    else:
        rows = torch.ones((b, w), dtype=torch.bool, device=keys.device)
    weights = torch.softmax(logits, dim=-1)
    weights = torch.where(rows[:, None, None, :, None], weights, 0.0)  # a row that sees nothing: NaN -> 0
    count = (rows.sum(-1) * group).clamp_min(1).to(dtype)  # [B]
    return weights.sum(dim=(2, 3)) / count[:, None, None]
