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


@pytest.mark.parametrize("seed", range(60))
def test_a_request_rebased_after_every_compression_is_planned_as_the_logical_one(seed):
    """Re-basing removes a compressed region's null entries and shifts everything after them; with the held
    region's candidates as a count (``CandidateSpans.held_before``), every later point and plan is the logical
    request's, moved by the tokens removed so far."""
    from cords_vllm.compress.plan import rebase_state

    rng = random.Random(1000 + seed)
    video, num_prompt = _layout(rng)
    budget = rng.randrange(8, 80)
    settings = BudgetSettings(budget=budget, recent=rng.randrange(0, budget), slack=rng.randrange(0, 20))
    logical, computed = RequestCompressionState(), 0
    rebased, removed, spans = RequestCompressionState(), 0, video
    compressions = 0
    while True:
        point = next_compression_point(logical, video, computed, num_prompt, settings, BS)
        moved = next_compression_point(rebased, spans, computed - removed, num_prompt - removed, settings, BS)
        assert moved == (None if point is None else point - removed)
        if point is None:
            break
        plan = plan_compression("r", _row(point, logical), point, num_prompt, video, logical, settings, BS)
        other = plan_compression("r", _row(point - removed, rebased), point - removed, num_prompt - removed, spans,
                                 rebased, settings, BS)
        assert (plan.num_keep, plan.num_keep_candidates, plan.num_held_candidates, plan.region_blocks - removed // BS) \
            == (other.num_keep, other.num_keep_candidates, other.num_held_candidates, other.region_blocks)
        logical, rebased, computed = apply_plan(logical, plan), apply_plan(rebased, other), point
        compressions += 1
        if rng.random() < 0.7:  # a turn boundary: re-base
            rebased, held, gone = rebase_state(rebased, BS)
            removed += gone
            shifted = CandidateSpans(tuple((max(a - removed, held), b - removed) for a, b in video.spans
                                           if b - removed > held))
            spans = shifted.held_before(held, rebased.held_candidates)
            assert spans.count_before(held) == rebased.held_candidates
    assert compressions == logical.compressions


def test_a_compression_leaves_the_budget_or_less_and_less_than_a_block_below_it():
    """After every compression the request holds at most ``budget`` video tokens (recent window, the rest of its
    block and the kept region together), and more than ``budget - block``: neither the block rounding nor the recent
    window sets a floor above the budget. The one exception: a region whose protected tokens (text, and the recent
    window's tokens in it) alone fill the blocks it keeps: then it keeps those blocks and evicts every other candidate
    but fewer than a block."""
    checked = minimum = 0
    for seed in range(200):
        rng = random.Random(5000 + seed)
        video, num_prompt = _layout(rng)
        budget = rng.randrange(8, 80)
        settings = BudgetSettings(budget=budget, recent=rng.randrange(0, budget), slack=rng.randrange(0, 20))
        state, computed = RequestCompressionState(), 0
        while (point := next_compression_point(state, video, computed, num_prompt, settings, BS)) is not None:
            plan = plan_compression("r", _row(point, state), point, num_prompt, video, state, settings, BS)
            state, computed = apply_plan(state, plan), point
            held = held_candidate_tokens(state, video, point, BS)
            protected = plan.num_keep - plan.num_keep_candidates
            if plan.num_keep > -(-protected // BS) * BS:  # the budget, not the protected tokens, set the blocks
                assert budget - BS < held <= budget
                checked += 1
            else:  # the blocks its protected tokens and recent window fill, and fewer than a block of others
                assert plan.num_keep_candidates < BS and held < max(budget, settings.recent + BS) + BS
                minimum += 1
            # the recent window stays whole: every one of the newest `recent` video tokens is still held
            assert held >= min(settings.recent, video.count_before(point))
    assert checked > minimum > 0


def test_small_budgets_hold_what_they_say():
    """The accuracy benchmark's 128-frame cells (16-token text, 1,026 video tokens, 32-token blocks, recent a
    quarter, no slack): 1/16, 1/8 and 1/4 hold different amounts, each at most its budget at every compression and
    within a block of it (before: 66, 162 and 290 video tokens for budgets of 64, 128 and 256)."""
    video, num_prompt = CandidateSpans(((16, 16 + 1026),)), 16 + 1026 + 24
    held_at_end = []
    for budget in (64, 128, 256):
        settings = BudgetSettings(budget=budget, recent=budget // 4, slack=0)
        state, computed = RequestCompressionState(), 0
        while (point := next_compression_point(state, video, computed, num_prompt, settings, 32)) is not None:
            plan = plan_compression("r", _row32(point, state), point, num_prompt, video, state, settings, 32)
            state, computed = apply_plan(state, plan), point
            assert budget - 32 < held_candidate_tokens(state, video, point, 32) <= budget
        held_at_end.append(held_candidate_tokens(state, video, num_prompt, 32))
    assert held_at_end == sorted(set(held_at_end))


def _row32(num_tokens: int, state: RequestCompressionState) -> list[int]:
    blocks = iter(range(1, 10_000))
    return [next(blocks) if i < state.held_blocks or i >= state.region_blocks else 0
            for i in range(-(-num_tokens // 32))]
