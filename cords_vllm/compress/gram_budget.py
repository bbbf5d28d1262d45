"""The memory a step's shared greedy run may take for its Gram matrices, and how its problems are split to fit.

A step's compressions share one greedy run on the kernel path (:class:`~cords_vllm.compress.step_triton.
GreedyOnRows`): every problem of every compression in the step, at the step's largest unit count ``M``, each with
two ``M x M`` fp32 Gram matrices. One compression is held to :data:`~cords_vllm.selection.cords_triton.
GRAM_LIMIT_BYTES`, but a step's run was not: sixteen token-unit compressions of a 7B model (7,744 units each)
would ask for about 7.7 GB on top of what vLLM budgeted. The run is split into consecutive groups of problems whose
Gram matrices together stay under :func:`step_gram_limit` (:func:`problem_chunks`); problems are independent, so
every problem keeps the units it kept in one run. A worker on a GPU lowers the limit to half the memory vLLM
leaves free once its KV cache is allocated (:func:`set_step_gram_limit`). Pure: no device, no torch.
"""

from __future__ import annotations

#: The default limit: one compression's (the kernel path's per-call limit).
DEFAULT_STEP_GRAM_LIMIT = 4 << 30

_limit = [DEFAULT_STEP_GRAM_LIMIT]


def gram_bytes(units: int) -> int:
    """Bytes of one problem's two fp32 Gram matrices (keys and values) at ``units`` units."""
    return 2 * 4 * units * units


def step_gram_limit() -> int:
    """The most Gram bytes one greedy launch of a step may hold."""
    return _limit[0]


def set_step_gram_limit(limit: int | None) -> int:
    """Set the limit (``None``: the default); at most the default, at least one problem's worth is always run.
    Returns the limit in force."""
    _limit[0] = DEFAULT_STEP_GRAM_LIMIT if limit is None else max(1, min(int(limit), DEFAULT_STEP_GRAM_LIMIT))
    return _limit[0]


def limit_from_free_memory(free_bytes: int) -> int:
    """Half the device memory left free after vLLM's allocations, at most the default."""
    return max(1, min(free_bytes // 2, DEFAULT_STEP_GRAM_LIMIT))


def problem_chunks(problems: int, units: int, limit: int | None = None) -> list[tuple[int, int]]:
    """Consecutive ``[start, stop)`` ranges of ``problems`` problems of ``units`` units each, each range's Gram
    matrices at most ``limit`` bytes (default :func:`step_gram_limit`); a problem larger than the limit alone runs
    alone (its compression was held to the per-call limit)."""
    limit = step_gram_limit() if limit is None else limit
    per_chunk = max(1, limit // max(gram_bytes(units), 1))
    return [(start, min(start + per_chunk, problems)) for start in range(0, problems, per_chunk)] or [(0, 0)]
