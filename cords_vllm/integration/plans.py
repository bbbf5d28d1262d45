"""The hand-off from the scheduler to the workers: each step's compression plans, on its ``SchedulerOutput``.

The plans are plain frozen dataclasses of host integers (:class:`~cords_vllm.compress.plan.CompressionPlan`),
pickled with the output to worker processes, like vLLM's own scheduler -> worker data. They ride in
``SchedulerOutput.kv_compaction_plans``: the field upstream patch ``patches/0001`` adds; on vLLM 0.32 the patch
table (:mod:`cords_vllm.integration.patches`) declares it on the class with an empty default, so every output
has it and a reader finds it where vLLM's own fields are. Set and read only through these two functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cords_vllm.compress.plan import CompressionPlan

#: The ``SchedulerOutput`` field carrying a step's plans (the name of upstream patch 0001).
PLANS_FIELD = "kv_compaction_plans"


def attach_plans(scheduler_output: Any, plans: Sequence[CompressionPlan]) -> None:
    """Hand this step's plans to the workers with its ``SchedulerOutput``."""
    setattr(scheduler_output, PLANS_FIELD, tuple(plans))


def plans_of(scheduler_output: Any) -> tuple[CompressionPlan, ...]:
    """The plans a ``SchedulerOutput`` carries (empty if none)."""
    return tuple(getattr(scheduler_output, PLANS_FIELD, None) or ())
