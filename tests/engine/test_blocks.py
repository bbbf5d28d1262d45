"""Real paged blocks: compression bounds what a request holds, and every block comes back to the pool."""

from __future__ import annotations

import time

import pytest

from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess.introspect import scheduler_of, snapshot
from cords_vllm.utils import cdiv
from tests.engine.conftest import BLOCK, CHUNK, TEXT_PROMPT, VIDEO_PROMPT, run_engine, video

pytestmark = pytest.mark.engine

BUDGET, SLACK = 256, 64


def _bound(prompt_len: int, video_tokens: int) -> int:
    """The issue's bound: ceil((budget + slack + chunk) / bs) blocks plus the blocks of non-video tokens."""
    return cdiv(BUDGET + SLACK + CHUNK, BLOCK) + cdiv(prompt_len - video_tokens, BLOCK)


def test_held_blocks_obey_the_bound_and_all_return(tiny_model):
    frames = video(64)
    prompts = [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}, {"prompt": TEXT_PROMPT}]
    run = run_engine(tiny_model, prompts, "cords", max_tokens=4, budget=BUDGET, slack=SLACK)
    video_tokens = 32 * 64
    assert len(run.events) >= 4
    uncompressed = cdiv(run.prompt_lens[0] + 4, BLOCK)
    video_req = max(run.max_blocks_held, key=run.max_blocks_held.get)
    assert run.max_blocks_held[video_req] <= _bound(run.prompt_lens[0], video_tokens) < uncompressed
    assert run.free_blocks_after == run.free_blocks_before


def _engine(make_llm, model):
    return make_llm(model, block_size=BLOCK, max_num_batched_tokens=4096, max_num_scheduled_tokens=CHUNK,
                    **kv_policy_args("cords", budget=BUDGET, slack=SLACK))


def _drive(llm, until):
    engine = llm.llm_engine
    outputs = {}
    for _ in range(10_000):
        if until(snapshot(llm)):
            return outputs
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            return outputs
    raise AssertionError("engine did not reach the expected state")


def _add(llm, req_id, frames):
    from vllm import SamplingParams

    llm.llm_engine.add_request(req_id, {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}},
                               SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def test_abort_mid_prefill_returns_every_block_and_state(tiny_model, make_llm):
    llm = _engine(make_llm, tiny_model)
    scheduler = scheduler_of(llm)
    free = snapshot(llm).free_blocks
    _add(llm, "victim", video(64))
    _add(llm, "other", video(32, seed=4))
    _drive(llm, lambda state: any(e.req_id.startswith("victim") for e in state.events))
    victim = next(r for r in scheduler.requests if r.startswith("victim"))
    assert scheduler.requests[victim].num_computed_tokens < scheduler.requests[victim].num_prompt_tokens
    assert snapshot(llm).requests[victim].compressions >= 1
    llm.llm_engine.abort_request(["victim"], internal=False)
    done = _drive(llm, lambda state: False)
    assert set(done) == {"other"}
    # finished requests reach the workers with the next step (as for vLLM's own runner state)
    llm.llm_engine.step()
    state = snapshot(llm)
    assert state.free_blocks == free
    assert state.requests == {} and state.held_by_workers == {}


def test_forced_preemption_after_compression_recomputes_exactly(tiny_model, make_llm):
    frames = video(64)
    solo = run_engine(tiny_model, [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}], "cords",
                      max_tokens=4, budget=BUDGET, slack=SLACK)
    llm = _engine(make_llm, tiny_model)
    scheduler = scheduler_of(llm)
    free = snapshot(llm).free_blocks
    _add(llm, "r", frames)
    _drive(llm, lambda state: len(state.events) >= 2)
    request = scheduler.running[0]
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())  # vLLM's own preemption path
    assert snapshot(llm).free_blocks == free
    done = _drive(llm, lambda state: False)
    assert request.num_preemptions == 1
    assert done["r"] == solo.token_ids[0]
    # recomputed from scratch: the same compressions happened again
    assert len(snapshot(llm).events) == 2 + len(solo.events)
    llm.llm_engine.step()
    state = snapshot(llm)
    assert state.free_blocks == free and state.held_by_workers == {}


def test_bf16_engine_compresses_with_the_packed_layout(tiny_model):
    frames = video(48)
    run = run_engine(tiny_model, [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}], "cords",
                     max_tokens=4, engine_kwargs={"dtype": "bfloat16"}, budget=BUDGET, slack=SLACK)
    assert len(run.events) >= 2 and len(run.token_ids[0]) == 4
    assert run.free_blocks_after == run.free_blocks_before
