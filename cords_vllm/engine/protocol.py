"""What crosses from the scheduler to the workers with each step: the step's compression plans.

vLLM 0.32's ``SchedulerOutput`` has no field for them (patch ``patches/0001`` adds one upstream); the plans
ride as one attribute, set and read only through :func:`attach_plans` and :func:`plans_of`. They are plain
frozen dataclasses of host integers (:class:`~cords_vllm.compress.plan.CompressionPlan`), pickled with the
output to worker processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cords_vllm.compress.plan import CompressionPlan

_PLANS_ATTR = "cords_vllm_plans"


def attach_plans(scheduler_output: Any, plans: Sequence[CompressionPlan]) -> None:
    """Attach this step's plans to its ``SchedulerOutput``."""
    setattr(scheduler_output, _PLANS_ATTR, tuple(plans))


def plans_of(scheduler_output: Any) -> tuple[CompressionPlan, ...]:
    """The plans attached to a ``SchedulerOutput`` (empty if none)."""
    return getattr(scheduler_output, _PLANS_ATTR, ())
