"""The blocks a compression frees are not zeroed in the step whose workers still copy kept tokens out of them.

On a hybrid model vLLM zeroes every block newly given to attention before the workers carry out the step's plans;
a freed block handed out again in the same step would lose the kept tokens it still holds
(``tests/engine/test_hybrid.py`` checks the engine end to end).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cords_vllm.compress.plan import CandidateSpans, CompressionPlan, RebasePlan
from cords_vllm.integration.handoff.plans import ZERO_FIELD, attach_plans, plans_of


def _plan(req_id: str, src: tuple[int, ...], keep_blocks: int, block_size: int = 4) -> CompressionPlan:
    return CompressionPlan(req_id=req_id, block_size=block_size, prev_region_blocks=0, region_blocks=len(src),
                           prev_held_blocks=0, src_blocks=src, num_keep=keep_blocks * block_size,
                           num_keep_candidates=keep_blocks * block_size, num_held_candidates=len(src) * block_size,
                           candidates=CandidateSpans(((0, len(src) * block_size),)))


def test_a_plan_frees_the_source_blocks_after_the_kept_ones():
    plan = _plan("a", (4, 5, 6, 9), keep_blocks=2)
    assert plan.kept_blocks == (4, 5) and plan.freed_blocks == (6, 9)
    assert _plan("b", (4, 5), keep_blocks=2).freed_blocks == ()


@pytest.mark.parametrize(("to_zero", "expected"), [
    ([6, 11, 9, 12], [11, 12]),  # freed blocks given out again in the step: spared; the others are still zeroed
    ([9, 6], None),  # only freed blocks: nothing left to zero (vLLM's "none" is None)
    ([11], [11]),  # no freed block among them: unchanged
    (None, None),  # a model without state layers: vLLM zeroes nothing
])
def test_attaching_plans_spares_their_freed_blocks_from_zeroing(to_zero, expected):
    output = SimpleNamespace(**{ZERO_FIELD: to_zero})
    plans = [_plan("a", (4, 5, 6), keep_blocks=2), RebasePlan("s", 8, 4, 100), _plan("b", (7, 9), keep_blocks=1)]
    attach_plans(output, plans)
    assert getattr(output, ZERO_FIELD) == expected
    assert plans_of(output) == tuple(plans)


def test_without_plans_the_zeroing_is_untouched():
    output = SimpleNamespace(**{ZERO_FIELD: [6, 9]})
    attach_plans(output, [])
    assert getattr(output, ZERO_FIELD) == [6, 9]
