"""Validation of the arguments of :meth:`~cords_vllm.selection.base.Selector.select`.

Every bad argument raises a ``ValueError`` whose message starts with the argument's name (``keys: ...``,
``budget: ...``), so that a caller can tell which one to fix.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from cords_vllm.selection.batch import GRANULARITIES


def check_group_index(group_index: Any, keys: torch.Tensor, granularity: str) -> None:
    """Validate ``group_index``'s type, shape and device (its order is checked where groups are built,
    :func:`~cords_vllm.selection.granularity.labelled_group_ids`)."""
    b_count, _, n_tok, _ = keys.shape
    if granularity == "token":
        raise ValueError("group_index: only meaningful at frame/block granularity")
    if not isinstance(group_index, torch.Tensor) or group_index.dtype != torch.long:
        raise ValueError(f"group_index: expected a long torch.Tensor [B, N], got {group_index!r:.80}")
    if tuple(group_index.shape) != (b_count, n_tok) or group_index.device != keys.device:
        raise ValueError(f"group_index: expected shape [B, N] = {(b_count, n_tok)} on {keys.device}, got "
                         f"{tuple(group_index.shape)} on {group_index.device}")


def check_select_inputs(
    keys: Any,
    values: Any,
    budget: Any,
    candidates: Any,
    granularity: Any,
    group_size: Any,
    per_head: Any,
    generator: Any,
    *,
    check_finite: bool = True,
) -> int:
    """Validate the arguments of :meth:`~cords_vllm.selection.base.Selector.select`; return the budget as an int.

    Everything is checked on the host except ``check_finite`` (no NaN or inf in ``keys`` / ``values``), which
    reads two flags back in one host read (a synchronisation on a GPU): ``False`` for a caller whose features
    are finite by construction.
    """
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [B, H, N, D] (problems, KV heads, tokens, "
                             f"head dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if values.shape != keys.shape:
        raise ValueError(f"values: shape {tuple(values.shape)} does not match keys shape {tuple(keys.shape)}")
    if values.dtype != keys.dtype:
        raise ValueError(f"values: dtype {values.dtype} does not match keys dtype {keys.dtype}")
    if values.device != keys.device:
        raise ValueError(f"values: device {values.device} does not match keys device {keys.device}")
    b_count, h_count, n_tok, d_head = keys.shape
    if b_count < 1 or h_count < 1 or d_head < 1:
        raise ValueError(f"keys: B, H and D must be >= 1, got shape {tuple(keys.shape)}")
    checked = [(name, t) for name, t in (("keys", keys), ("values", values)) if t.numel()] if check_finite else []
    if checked:  # min and max propagate NaN and reach +-inf: one cheap pass, no temporary; one host read
        finite = torch.stack([torch.isfinite(torch.stack(torch.aminmax(t))).all() for _, t in checked]).tolist()
        for (name, _), ok in zip(checked, finite, strict=True):
            if not ok:
                raise ValueError(f"{name}: contains NaN or inf")

    if isinstance(budget, bool):
        raise ValueError(f"budget: expected a non-negative int, got {budget!r}")
    try:
        budget = operator.index(budget)
    except TypeError:
        raise ValueError(f"budget: expected a non-negative int, got {budget!r}") from None
    if budget < 0:
        raise ValueError(f"budget: must be >= 0, got {budget}")

    if candidates is not None:
        if not isinstance(candidates, torch.Tensor):
            raise ValueError(f"candidates: expected a bool torch.Tensor [B, N] or None, got "
                             f"{type(candidates).__name__}")
        if candidates.dtype != torch.bool:
            raise ValueError(f"candidates: expected dtype torch.bool, got {candidates.dtype}")
        if tuple(candidates.shape) != (b_count, n_tok):
            raise ValueError(f"candidates: expected shape [B, N] = {(b_count, n_tok)}, got "
                             f"{tuple(candidates.shape)}")
        if candidates.device != keys.device:
            raise ValueError(f"candidates: device {candidates.device} does not match keys device "
                             f"{keys.device}")

    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: expected a positive int or None, got {group_size!r}")
    elif granularity != "token":
        raise ValueError(f"group_size: required (tokens per {granularity}) at {granularity} granularity")
    if not isinstance(per_head, bool):
        raise ValueError(f"per_head: expected a bool, got {per_head!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    return budget
