"""Re-basing a streaming session at its next turn: the evicted part of its region leaves the request (engine core).

A compressed request's row is ``[k held blocks][j - k null blocks][the rest]`` (:mod:`cords_vllm.compress.plan`).
Within a turn the null entries stay (the workers' attention view skips them); when the session's next turn
arrives (``Scheduler._update_request_as_session``, the one moment vLLM hands a session's whole state to the
workers again), :func:`remove_range` takes the ``(j - k) * block_size`` tokens they stood for out of vLLM's
``Request``: its token lists, its row of blocks, its computed and prompt counts and the multimodal inputs that
lay wholly in the evicted part. The workers do the same to their copy when the turn reaches them
(:class:`~cords_vllm.compress.plan.RebasePlan`), keeping every remaining token's rotary position explicitly.

What a session holds between turns is then its held blocks, its recent tokens and its text, whatever it has
pushed: its length (what ``--max-model-len`` counts), its host state and the cost of each turn follow that.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any


class RebaseError(RuntimeError):
    """A session's request disagrees with its compression state (a bug, never expected)."""


def remove_range(request: Any, row: list, held: int, removed: int, block_size: int, null_block: Any,
                 drop_inputs: bool) -> int:
    """Remove tokens ``[held, held + removed)`` (null blocks of its row) from a waiting session's ``request``.

    Parameters
    ----------
    request:
        A vLLM ``Request`` between turns (every token of its prompt computed up to ``num_computed_tokens``).
    row:
        Its row of ``KVCacheBlock`` (the KV cache manager's own list, edited in place).
    held, removed:
        Block-aligned token counts (:class:`~cords_vllm.compress.plan.RebasePlan`).
    drop_inputs:
        Whether the multimodal inputs that lay wholly in ``[0, held + removed)`` may leave ``mm_features``
        (only when no encoder input of the request is referenced by index any more); the others are shifted.

    Returns
    -------
    int
        Multimodal inputs dropped.
    """
    end = held + removed
    if removed == 0:
        return 0
    if held % block_size or removed % block_size or request.num_computed_tokens < end:
        raise RebaseError(f"request {request.request_id}: cannot remove tokens [{held}, {end}) "
                          f"({request.num_computed_tokens} computed, blocks of {block_size})")
    first, last = held // block_size, end // block_size
    if any(block is not null_block for block in row[first:last]):
        raise RebaseError(f"request {request.request_id}: row entries [{first}, {last}) are not all null")
    del row[first:last]
    del request._all_token_ids[held:end]
    del request.prompt_token_ids[held:end]
    request.num_prompt_tokens -= removed
    request.num_computed_tokens -= removed
    kept, dropped = [], 0
    for feature in request.mm_features:
        pos = feature.mm_position
        if drop_inputs and pos.offset + pos.length <= end:
            dropped += 1
            continue
        if pos.offset + pos.length <= held:  # kept (not droppable yet) and before the removed range
            kept.append(feature)
            continue
        # an input straddling the removed range keeps its length: its place starts before the held end, where
        # nothing reads it (it is computed, and candidates are counted from the held end on)
        feature.mm_position = replace(pos, offset=pos.offset - removed)
        kept.append(feature)
    request.mm_features[:] = kept
    return dropped
