"""Attention-output fidelity of a compressed cache, and the CoRDS paper's Proposition 1 bound.

For queries ``q`` and a cache ``C = {(k_i, v_i)}``, ``Attn(q, C) = sum_i a_i(q) v_i`` with
``a(q) = softmax(q . k / sqrt(D))``. A compressed cache keeps a subset ``S``. Two approximations:

* **drop** (what an engine does): attention over the kept tokens only, renormalised;
* **cluster-weighted** (Proposition 1): every token ``i`` is assigned to its nearest kept token
  ``j*(i)`` and its attention mass moves there: ``Attn_w(q, S) = sum_i a_i(q) v_{j*(i)}``.

Proposition 1: ``||Attn - Attn_w|| <= sqrt(sum_i a_i ||v_i - v_{j*(i)}||^2)
<= sqrt(1 / (1 - alpha) * sum_i a_i d_alpha(i, S))``. Both inequalities need ``j*(i)`` to be the
``d_alpha``-nearest kept token (``argmin_j alpha ||k_i - k_j||^2 + (1 - alpha) ||v_i - v_j||^2``):
then ``(1 - alpha) ||v_i - v_{j*}||^2 <= d_alpha(i, S)``. (The paper's proof writes the middle term as
``min_j ||v_i - v_j||^2``, which only matches a value-space assignment; with the ``d_alpha``
assignment used here both stated bounds hold.) ``alpha = 0.5`` assigns by plain joint ``[k; v]``
distance, the paper's ``j*``.

Attention is computed per KV head; grouped-query attention is supported (query head ``h`` reads KV
head ``h // (Hq / H)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cords_vllm.lab.fidelity.neighbours import nearest_kept
from cords_vllm.selection.base import compute_dtype


@dataclass(frozen=True)
class AttentionError:
    """Fidelity of one compressed cache for a set of queries; every field is ``[B, Hq, Q]``.

    Attributes
    ----------
    drop:
        Relative error ``||Attn(q, C) - Attn(q, S)|| / ||Attn(q, C)||`` of attention over kept tokens.
    cluster:
        Relative error of the cluster-weighted approximation ``Attn_w``.
    cluster_abs:
        Absolute error ``||Attn(q, C) - Attn_w(q, S)||``.
    bound_values:
        ``sqrt(sum_i a_i ||v_i - v_{j*(i)}||^2)`` (absolute), the first bound of Proposition 1.
    bound:
        ``sqrt(1/(1-alpha) sum_i a_i d_alpha(i, S))`` (absolute), Proposition 1 in ``d_alpha`` form.
    reference_norm:
        ``||Attn(q, C)||``.
    """

    drop: torch.Tensor
    cluster: torch.Tensor
    cluster_abs: torch.Tensor
    bound_values: torch.Tensor
    bound: torch.Tensor
    reference_norm: torch.Tensor


def _check(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
    for name, t in (("queries", queries), ("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point 4-D tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: contains NaN or inf")
    if values.shape != keys.shape:
        raise ValueError(f"values: shape {tuple(values.shape)} does not match keys {tuple(keys.shape)}")
    b, h, n, d = keys.shape
    if queries.shape[0] != b or queries.shape[3] != d or queries.shape[1] % h:
        raise ValueError(f"queries: expected [B, Hq, Q, D] with B={b}, D={d} and Hq a multiple of H={h}, "
                         f"got {tuple(queries.shape)}")
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or tuple(keep.shape) not in (
            (b, n), (b, h, n)):
        raise ValueError(f"keep: expected a bool tensor [B, N] or [B, H, N] = {(b, n)} / {(b, h, n)}, got "
                         f"{getattr(keep, 'shape', type(keep).__name__)}")
    for name, t in (("keys", keys), ("values", values), ("keep", keep)):
        if t.device != queries.device:
            raise ValueError(f"{name}: device {t.device} does not match queries device {queries.device}")


def attention_error(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    keep: torch.Tensor,
    *,
    alpha: float = 0.5,
    scale: float | None = None,
) -> AttentionError:
    """Attention-output error of the cache compressed to ``keep``, for the given queries.

    Parameters
    ----------
    queries:
        ``[B, Hq, Q, D]``.
    keys, values:
        ``[B, H, N, D]`` full cache (``Hq`` a multiple of ``H``).
    keep:
        ``bool [B, N]`` (same tokens for every head) or ``[B, H, N]``; at least one token per head.
    alpha:
        Weight of the ``d_alpha`` assignment and bound, in ``[0, 1)``.
    scale:
        Softmax scale; default ``1 / sqrt(D)``.

    Returns
    -------
    AttentionError
        All errors and bounds per query. Computed in float32 (float64 for float64 inputs).
    """
    _check(queries, keys, values, keep)
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha: must be in [0, 1), got {alpha}")
    b, h, n, d = keys.shape
    hq = queries.shape[1]
    dt = compute_dtype(keys.dtype)
    q, k, v = queries.to(dt), keys.to(dt), values.to(dt)
    keep_h = keep if keep.dim() == 3 else keep[:, None, :].expand(b, h, n)
    if not bool(keep_h.any(-1).all()):
        raise ValueError("keep: every problem (and head) must keep at least one token")
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    # d_alpha-nearest kept token per KV head: d_alpha = ||x'_i - x'_j||^2 with x' = [sqrt(a) k, sqrt(1-a) v].
    feats = torch.cat([math.sqrt(alpha) * k, math.sqrt(1.0 - alpha) * v], dim=-1).reshape(b * h, n, 2 * d)
    assign, d_alpha = nearest_kept(feats, keep_h.reshape(b * h, n), metric="sqeuclidean")
    assign, d_alpha = assign.view(b, h, n), d_alpha.view(b, h, n)
    v_assigned = torch.gather(v, 2, assign.unsqueeze(-1).expand(b, h, n, d))
    v_err2 = ((v - v_assigned) ** 2).sum(-1)  # [B, H, N]

    group = hq // h
    def per_query_head(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(group, dim=1)

    logits = torch.matmul(q, per_query_head(k).transpose(-1, -2)) * scale  # [B, Hq, Q, N]
    attn = torch.softmax(logits, dim=-1)
    full = torch.matmul(attn, per_query_head(v))
    kept_q = per_query_head(keep_h)[:, :, None, :]
    attn_drop = torch.softmax(logits.masked_fill(~kept_q, float("-inf")), dim=-1)
    dropped = torch.matmul(attn_drop, per_query_head(v))
    clustered = torch.matmul(attn, per_query_head(v_assigned))

    ref = torch.linalg.vector_norm(full, dim=-1)
    denom = ref.clamp_min(torch.finfo(dt).tiny)
    cluster_abs = torch.linalg.vector_norm(full - clustered, dim=-1)
    bound_values = torch.sqrt((attn * per_query_head(v_err2)[:, :, None, :]).sum(-1))
    bound = torch.sqrt((attn * per_query_head(d_alpha)[:, :, None, :]).sum(-1) / (1.0 - alpha))
    return AttentionError(
        drop=torch.linalg.vector_norm(full - dropped, dim=-1) / denom,
        cluster=cluster_abs / denom,
        cluster_abs=cluster_abs,
        bound_values=bound_values,
        bound=bound,
        reference_norm=ref,
    )
