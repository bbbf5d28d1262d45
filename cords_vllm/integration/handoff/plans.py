"""The hand-off from the scheduler to the workers: each step's compression plans, on its ``SchedulerOutput``.

The plans are plain frozen dataclasses of host integers (:class:`~cords_vllm.compress.plan.CompressionPlan`),
pickled with the output to worker processes, like vLLM's own scheduler -> worker data. They ride in
``SchedulerOutput.kv_compaction_plans``: the field upstream patch ``patches/0001`` adds; on vLLM 0.32 the patch
table (:mod:`cords_vllm.integration.patch.table`) declares it on the class with an empty default, so every output
has it and a reader finds it where vLLM's own fields are. Set and read only through these two functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cords_vllm.compress.plan import CompressionPlan

#: The ``SchedulerOutput`` field carrying a step's plans (the name of upstream patch 0001).
PLANS_FIELD = "kv_compaction_plans"


#: vLLM's ``SchedulerOutput`` field of the new blocks a worker zeroes before this step's plans are carried out.
ZERO_FIELD = "new_block_ids_to_zero"


def attach_plans(scheduler_output: Any, plans: Sequence[CompressionPlan]) -> None:
    """Hand this step's plans to the workers with its ``SchedulerOutput``, and keep vLLM from zeroing the blocks
    they free (:func:`spare_freed_blocks`)."""
    setattr(scheduler_output, PLANS_FIELD, tuple(plans))
    spare_freed_blocks(scheduler_output, plans)


def spare_freed_blocks(scheduler_output: Any, plans: Sequence[Any]) -> None:
    """Take the blocks ``plans`` free out of the step's ``new_block_ids_to_zero``.

    A model with recurrent-state layers (Qwen3.5's Gated DeltaNet) shares one block pool, and one memory, between
    its attention and state groups, so vLLM zeroes every block newly given to attention at the start of the
    workers' ``_update_states`` (a page that held state bytes could read as NaN). A compression frees its region's
    unkept blocks before this step's allocation, which may hand them out again at once; the workers copy the kept
    tokens out of them only after ``_update_states``, so zeroing them first would replace those tokens with zeros.
    They held this attention group's own keys and values, finite like any freed block's on a model without state
    layers (where vLLM zeroes nothing), and the request given one writes before reading it: they need no zeroing.
    """
    to_zero = getattr(scheduler_output, ZERO_FIELD, None)
    if not to_zero:
        return
    freed = {block for plan in plans if isinstance(plan, CompressionPlan) for block in plan.freed_blocks}
    if freed:
        setattr(scheduler_output, ZERO_FIELD, [block for block in to_zero if block not in freed] or None)


def plans_of(scheduler_output: Any) -> tuple[CompressionPlan, ...]:
    """The plans a ``SchedulerOutput`` carries (empty if none)."""
    return tuple(getattr(scheduler_output, PLANS_FIELD, None) or ())
