"""Stream-mode accuracy: questions placed after their needle, answered mid-stream as one-shot requests over the
same tokens, and bounded held video under a policy."""

from __future__ import annotations

import numpy as np
import pytest

from cords_vllm.lab.bench.accuracy import EngineShape, blank_needles
from cords_vllm.lab.bench.stream_accuracy import plan_stream, run_stream_policy, run_streams, stream_engine_args
from cords_vllm.lab.vqa import make_split, shipped_checkpoint

pytestmark = pytest.mark.engine

PUSH_FRAMES, DELAY = 8, 2
SHAPE = EngineShape(chunk=64, batch=4)
#: 8 frames = 4 temporal patches of 16 tokens, and the clip's two vision markers.
TOKENS_PER_PUSH = 4 * 16 + 2


@pytest.fixture(scope="module")
def plans():
    """One stream per family: a colour needle in push 6 of 8 (the stream runs past the video), an order pair,
    a count flash, and a static dot (no localised needle: asked after the whole video)."""
    examples = make_split(["colour", "order", "count", "static"], 1, "heldout")
    return [plan_stream(e, PUSH_FRAMES, DELAY) for e in examples]


def test_the_question_follows_the_needle_by_the_delay_and_the_video_is_pushed_unchanged(plans):
    for plan in plans:
        example = plan.example
        frames = np.concatenate(plan.clips)
        assert all(len(c) == PUSH_FRAMES for c in plan.clips)
        assert len(plan.clips) == plan.needle_push + 1 + DELAY
        shown = min(len(frames), len(example.frames))
        assert np.array_equal(frames[:shown], example.frames[:shown])
        if example.family != "static":
            last = max(example.needle_frames)
            assert plan.needle_push * PUSH_FRAMES <= last < (plan.needle_push + 1) * PUSH_FRAMES
            # frames after the video continue its background and never show the needle again
            clean = blank_needles(example).frames
            assert all(any(np.array_equal(f, c) for c in clean) for f in frames[len(example.frames):])
    colour, _, _, static = plans
    assert len(np.concatenate(colour.clips)) > len(colour.example.frames)  # the needle sits in the last pushes
    assert static.needle_push == len(static.example.frames) // PUSH_FRAMES - 1
    assert len(static.clips) * PUSH_FRAMES == len(static.example.frames) + DELAY * PUSH_FRAMES


def test_full_kv_stream_answers_equal_one_shot_requests_over_the_same_tokens(plans, make_llm):
    from vllm import SamplingParams

    from cords_vllm.integration.inprocess.introspect import snapshot

    kwargs = stream_engine_args(shipped_checkpoint(), plans, SHAPE)
    llm = make_llm(kwargs.pop("model"), **kwargs)
    free = snapshot(llm).free_blocks
    streams = run_streams(llm, plans, batch=3)  # fewer slots than streams: one starts when another answered
    assert [s.video_tokens for s in streams] == [len(p.clips) * TOKENS_PER_PUSH for p in plans]
    assert [s.held_candidate_tokens for s in streams] == [s.video_tokens for s in streams]
    outs = llm.generate([p.one_shot_request() for p in plans], SamplingParams(temperature=0.0, max_tokens=1),
                        use_tqdm=False)
    assert [s.answer for s in streams] == [o.outputs[0].text for o in outs]
    assert [s.answer for s in streams] == [p.example.answer for p in plans]
    assert snapshot(llm).free_blocks == free  # every answered stream was ended and returned its blocks


def test_streams_under_cords_hold_at_most_the_budget_when_answering(plans):
    budget = 64
    streams = run_stream_policy(shipped_checkpoint(), plans, "cords", budget, SHAPE)
    for plan, stream in zip(plans, streams, strict=True):
        assert stream.video_tokens == len(plan.clips) * TOKENS_PER_PUSH
        # a compression rounds the kept old tokens down to whole blocks, leaving between budget - block and budget;
        # what the last push brought after its last compression point (less than a block) comes on top
        assert budget - SHAPE.block_size < stream.held_candidate_tokens <= budget + SHAPE.block_size
