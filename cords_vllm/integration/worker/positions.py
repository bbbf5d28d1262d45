"""1-D rotary positions of re-based streams (worker processes).

vLLM 0.32's V1 model runner (``GPUModelRunner._prepare_inputs``, which the CPU runner inherits) gives each token
of a model without M-RoPE the position ``num_computed_tokens + its place in the step``: its index in the request.
A re-based stream (:mod:`cords_vllm.integration.engine_core.rebase`) has lost the tokens its compressions
evicted, all of them before every token it computes from then on, so each new token's index is short of its
place in the stream by exactly the tokens removed so far. Its position must be ``index + removed``: the stream's
largest position plus one for its first new token, as if nothing had left the request (the tokens it holds keep
the positions they were cached with, already applied to their keys).

The offset is added to the runner's ``positions`` buffer after ``_prepare_inputs`` has filled it, and only
there: the slot mapping (computed inside ``_prepare_inputs`` from the same index positions), ``seq_lens`` and the
block rows stay request indices. One in-place add per re-based request in the step (a kernel launch on a GPU, no
host sync, no upload). M-RoPE models keep explicit positions per request instead
(:meth:`~cords_vllm.integration.worker.turns.SessionTurns.mrope_positions`), and a request never re-based
has no offset: neither is touched.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def shift_positions(positions: torch.Tensor, query_start_loc: np.ndarray, offsets: Iterable[tuple[int, int]]) -> int:
    """Add each request's offset to the positions of its tokens in the step.

    Parameters
    ----------
    positions:
        ``int64 [T]`` (the runner's device): the step's token positions, request after request.
    query_start_loc:
        ``int32 [R + 1]`` (host): where each request's tokens start in ``positions`` (batch row order).
    offsets:
        ``(batch row, offset)`` of each request to shift (tokens removed from it so far).

    Returns
    -------
    int
        Requests shifted (those with tokens in the step and a non-zero offset).
    """
    shifted = 0
    for row, offset in offsets:
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        if offset and end > start:
            positions[start:end] += offset
            shifted += 1
    return shifted
