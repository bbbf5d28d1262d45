"""Compression points: where a request is compressed depends on its layout and settings only."""

from __future__ import annotations

import random

import pytest

from cords_vllm.compress.plan import (
    BudgetSettings,
    CandidateSpans,
    RequestCompressionState,
    apply_plan,
    held_candidate_tokens,
    next_compression_point,
    plan_compression,
)

BS = 8


def _layout(rng: random.Random) -> tuple[CandidateSpans, int]:
    spans, pos = [], rng.randrange(0, 20)
    for _ in range(rng.randrange(1, 4)):
        length = rng.randrange(10, 200)
        spans.append((pos, pos + length))
        pos += length + rng.randrange(0, 30)
    return CandidateSpans(tuple(spans)), pos + rng.randrange(1, 20)


def _row(num_tokens: int, state: RequestCompressionState) -> list[int]:
    """A row consistent with ``state``: kept blocks, nulls up to the region, then fresh blocks."""
    blocks = iter(range(1, 10_000))
    region, kept = state.region_blocks, state.held_blocks
    return [next(blocks) if i < kept or i >= region else 0 for i in range(-(-num_tokens // BS))]


@pytest.mark.parametrize("seed", range(60))
def test_the_next_point_is_the_first_position_that_plans_a_compression(seed):
    rng = random.Random(seed)
    video, num_prompt = _layout(rng)
    budget = rng.randrange(8, 80)
    settings = BudgetSettings(budget=budget, recent=rng.randrange(0, budget), slack=rng.randrange(0, 20))
    state, computed, points = RequestCompressionState(), 0, []
    while True:
        point = next_compression_point(state, video, computed, num_prompt, settings, BS)
        brute = next((p for p in range(computed + 1, num_prompt)
                      if plan_compression("r", _row(p, state), p, num_prompt, video, state, settings, BS)), None)
        assert point == brute
        if point is None:
            break
        # a chunk ending at the point never lets the request hold more than its bounded footprint
        assert held_candidate_tokens(state, video, point, BS) <= settings.budget + settings.slack + 2 * BS
        plan = plan_compression("r", _row(point, state), point, num_prompt, video, state, settings, BS)
        state, computed = apply_plan(state, plan), point
        points.append(point)
    assert points == sorted(set(points))


@pytest.mark.parametrize("seed", range(30))
def test_compacting_a_row_touches_only_what_changes_and_leaves_kept_then_nulls(seed):
    rng = random.Random(seed)
    video, num_prompt = _layout(rng)
    settings = BudgetSettings(budget=48, recent=rng.randrange(0, 48), slack=rng.randrange(0, 20))
    row = list(range(1, -(-num_prompt // BS) + 1))  # fresh blocks 1..n
    state, computed = RequestCompressionState(), 0
    while (point := next_compression_point(state, video, computed, num_prompt, settings, BS)) is not None:
        plan = plan_compression("r", row, point, num_prompt, video, state, settings, BS)
        before = list(row)
        plan.compact_row(row, 0)
        k, j = plan.num_keep // BS, plan.region_blocks
        held_before = [b for b in before[:j] if b != 0]
        assert row[:k] == held_before[:k] and row[k:j] == [0] * (j - k) and row[j:] == before[j:]
        state, computed = apply_plan(state, plan), point
