"""Feature layout: ``[B, H, N, D]`` keys/values -> ``[P, M, Dk + Dv]`` unit features in the compute dtype.

Scope: joint (``P = B`` problems, the keys of all ``H`` heads then the values of all heads, ``Dk = Dv =
H * D``) or per head (``P = B * H``, ``Dk = Dv = D``). Arithmetic dtype: float32, or float64 for
float64 inputs.

Token features are one copy of the cache in the compute dtype. Group centroids avoid that copy when
every problem shares one candidate mask (no mask, or the same rows, e.g. the layers of one request):
the groups are then summed from the input in bounded chunks converted to the compute dtype, reading
the cache once and allocating only ``[P, G, F]`` plus one chunk (a full-size temporary would cost
page faults on every call for large caches). Otherwise they are accumulated from token features.
Telling the masks apart and finding the candidates reads the mask back to the host; a caller that knows the
candidate count on the host (``max_candidates``) skips that: each problem's groups are then gathered from its
own candidate positions, found on the device, and summed the same way (no host read).
"""

from __future__ import annotations

import torch

from cords_vllm.selection.granularity import candidate_ranks, group_centroids, group_ids

#: Elements converted to the compute dtype at a time when summing groups of a low-precision cache.
CHUNK_ELEMENTS = 1 << 20


def _layout(keys: torch.Tensor, values: torch.Tensor, per_head: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, M, D]`` keys/values (any dtype) -> ``[P, M, 2 * Dh]`` in ``dtype`` (one copy)."""
    b, h, m, d = keys.shape
    if per_head:
        out = torch.empty((b, h, m, 2 * d), dtype=dtype, device=keys.device)
        out[..., :d].copy_(keys)
        out[..., d:].copy_(values)
        return out.view(b * h, m, 2 * d)
    # [B, M, 2, H, D]: the keys of all heads, then the values of all heads.
    out = torch.empty((b, m, 2, h, d), dtype=dtype, device=keys.device)
    out[:, :, 0].copy_(keys.permute(0, 2, 1, 3))
    out[:, :, 1].copy_(values.permute(0, 2, 1, 3))
    return out.view(b, m, 2 * h * d)


def token_features(keys: torch.Tensor, values: torch.Tensor, per_head: bool,
                   dtype: torch.dtype) -> torch.Tensor:
    """``[P, N, F]`` token features (``F = 2 * H * D`` joint, ``2 * D`` per head)."""
    return _layout(keys, values, per_head, dtype)


def _group_means_into(out: torch.Tensor, x: torch.Tensor, pos: torch.Tensor | None, first: int,
                      group_size: int) -> None:
    """Write the mean of each group of ``group_size`` selected tokens of ``x`` into ``out``.

    ``x`` is ``[B, H, N, D]``; ``out`` is a (possibly strided) ``[B, H, G, D]`` view in the compute
    dtype. The selected tokens are ``pos`` (``long [G * g]``, shared by every problem, or ``long [B, G * g]``,
    one row per problem) or, if ``pos`` is None, the run of ``G * g`` tokens starting at ``first``. A
    low-precision ``x`` is converted chunk by chunk through one reused buffer (the loop is over chunks of
    groups, never over tokens).
    """
    b, h, _, d = x.shape
    n_groups = out.shape[2]
    if n_groups == 0:
        return
    per_chunk = n_groups if x.dtype == out.dtype else max(1, CHUNK_ELEMENTS // max(1, b * h * group_size * d))
    per_chunk = min(per_chunk, n_groups)
    buf = None
    if x.dtype != out.dtype:
        buf = torch.empty((b, h, per_chunk, group_size, d), dtype=out.dtype, device=x.device)
    for start in range(0, n_groups, per_chunk):
        stop = min(n_groups, start + per_chunk)
        lo, hi = start * group_size, stop * group_size
        if pos is None:
            part = x[:, :, first + lo:first + hi]
        elif pos.dim() == 1:
            part = x.index_select(2, pos[lo:hi])
        else:
            part = torch.gather(x, 2, pos[:, None, lo:hi, None].expand(b, h, hi - lo, d))
        part = part.reshape(b, h, stop - start, group_size, d)
        if buf is not None:
            part = buf[:, :, :stop - start].copy_(part)
        torch.sum(part, dim=3, out=out[:, :, start:stop])
    out.div_(group_size)


def group_features(
    keys: torch.Tensor,
    values: torch.Tensor,
    candidates: torch.Tensor,
    group_size: int,
    n_groups: int,
    per_head: bool,
    dtype: torch.dtype,
    max_candidates: int | None = None,
) -> torch.Tensor:
    """``[P, G, F]`` centroids of the groups of ``group_size`` consecutive candidates.

    Parameters
    ----------
    keys, values:
        ``[B, H, N, D]``.
    candidates:
        ``bool [B, N]``.
    group_size:
        Tokens per group ``g``.
    n_groups:
        ``G``: group slots per problem; only the full groups (the first ``n_candidates // g``) are
        meaningful, the other slots are padding whose content is unspecified.
    per_head, dtype:
        Scope and compute dtype.
    max_candidates:
        The largest candidate count of a problem, when the caller knows it on the host: then nothing is read
        back (each problem's first ``max_candidates // g * g`` candidate positions are found on the device;
        slots past a problem's own full groups are padding).
    """
    b, h, n, _ = keys.shape
    if max_candidates is not None:
        span = max_candidates // group_size * group_size
        # Candidate positions first, in token order (a stable sort of "not a candidate"), per problem.
        rows = torch.sort((~candidates).to(torch.uint8), dim=-1, stable=True).indices[:, :span]
        return _centroids(keys, values, rows, 0, span // group_size, group_size, n_groups, per_head, dtype)
    shared = b == 1 or bool((candidates == candidates[:1]).all())
    if shared:
        pos = torch.nonzero(candidates[0]).flatten()
        n_full = pos.numel() // group_size
        span = n_full * group_size
        pos = pos[:span]
        contiguous = span > 0 and int(pos[-1]) - int(pos[0]) + 1 == span
        first, sel = (int(pos[0]), None) if contiguous else (0, pos)
        return _centroids(keys, values, sel, first, n_full, group_size, n_groups, per_head, dtype)
    feats = _layout(keys, values, per_head, dtype)
    cand = candidates
    if per_head:
        cand = cand[:, None, :].expand(b, h, n).reshape(b * h, n)
    rank, _ = candidate_ranks(cand)
    return group_centroids(feats, group_ids(rank, group_size), n_groups)


def _centroids(keys: torch.Tensor, values: torch.Tensor, sel: torch.Tensor | None, first: int, n_full: int,
               group_size: int, n_groups: int, per_head: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[P, G, F]``: the means of the ``n_full`` groups of the selected tokens (see :func:`_group_means_into`)
    written straight into the unit layout (no intermediate copies); the other slots are zeros."""
    b, h, _, d = keys.shape
    if per_head:
        cent = torch.zeros((b, h, n_groups, 2, d), dtype=dtype, device=keys.device)
        k_out, v_out = cent[:, :, :n_full, 0], cent[:, :, :n_full, 1]
    else:
        cent = torch.zeros((b, n_groups, 2, h, d), dtype=dtype, device=keys.device)
        k_out = cent[:, :n_full, 0].permute(0, 2, 1, 3)
        v_out = cent[:, :n_full, 1].permute(0, 2, 1, 3)
    _group_means_into(k_out, keys, sel, first, group_size)
    _group_means_into(v_out, values, sel, first, group_size)
    return cent.view(b * h if per_head else b, n_groups, 2 * d if per_head else 2 * h * d)
