"""A stream far longer than the KV pool: the start-up rule asks for its bounded footprint, blocks stay flat."""

from __future__ import annotations

import pytest

from cords_vllm.compress.plan import BudgetSettings, stream_footprint_blocks
from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.integration.inprocess.introspect import snapshot
from cords_vllm.integration.inprocess.session import EngineSession
from cords_vllm.lab.bench.offline import kv_bytes_per_block
from tests.engine.conftest import BLOCK, video

pytestmark = pytest.mark.engine

POOL = 24  # blocks of 32 tokens: 768 tokens
BUDGET, SLACK, MAX_TEXT = 192, 64, 128
CLIP = "<|vision_start|><|video_pad|><|vision_end|>"


def _llm(make_llm, model, max_model_len: int, pool: int = POOL, **config):
    pool_bytes = (pool + 1) * kv_bytes_per_block(model, BLOCK, 4)  # + the null block
    return make_llm(model, block_size=BLOCK, max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
                    max_num_scheduled_tokens=512, kv_cache_memory_bytes=pool_bytes,
                    **kv_policy_args("cords", budget=BUDGET, slack=SLACK, **config))


def test_without_max_text_tokens_vllm_still_asks_for_one_max_model_len_request(tiny_model, make_llm):
    footprint = r"footprint does not fit.*'max_text_tokens'.*default min\(max-model-len, 8192\)"
    with pytest.raises(ValueError, match=footprint):
        _llm(make_llm, tiny_model, max_model_len=4 * POOL * BLOCK)


def test_by_default_the_pool_must_hold_the_footprint_of_8192_text_tokens_not_max_model_len(tiny_model, make_llm):
    from cords_vllm.config import KVPolicyConfig

    assert KVPolicyConfig.parse("cords", {}).text_limit(32768) == 8192
    assert KVPolicyConfig.parse("cords", {"max_text_tokens": 100}).text_limit(64) == 64
    blocks = -(-(8192 + BUDGET + SLACK + 2 * BLOCK) // BLOCK)  # 267 blocks: far fewer than 32768 tokens
    pool_bytes = (blocks + 1) * kv_bytes_per_block(tiny_model, BLOCK, 4)
    engine = {"block_size": BLOCK, "max_model_len": 32768, "max_num_batched_tokens": 32768,
              "kv_cache_memory_bytes": pool_bytes}
    llm = make_llm(tiny_model, **engine, **kv_policy_args("cords", budget=BUDGET, slack=SLACK))
    assert snapshot(llm).total_blocks == blocks
    del llm
    settle()
    with pytest.raises(ValueError, match="max seq len"):  # without a policy, vLLM's own rule
        make_llm(tiny_model, **engine)


def test_a_stream_runs_to_twenty_pools_with_flat_blocks(tiny_model, make_llm):
    pushes = 20 * POOL * BLOCK // 128 + 1  # 128 video tokens a push
    # --max-model-len need not cover what the stream pushes: a re-based stream's length is what it holds
    llm = _llm(make_llm, tiny_model, max_model_len=1024, max_text_tokens=MAX_TEXT)
    free = snapshot(llm).free_blocks
    assert free == POOL  # the pool really is smaller than the stream by 20x
    bound = stream_footprint_blocks(MAX_TEXT, BudgetSettings(BUDGET, BUDGET // 4, SLACK), BLOCK)
    session = EngineSession(llm, "camera")
    held = []
    for i in range(pushes):
        session.push({"prompt": ("<|im_start|>user\n" if i == 0 else "") + CLIP,
                      "multi_modal_data": {"video": video(4, seed=i % 7)}})
        held.append(snapshot(llm).requests[session.request_id])
    assert held[-1].candidate_tokens + held[-1].evicted_tokens >= 20 * POOL * BLOCK
    assert max(h.held_blocks for h in held) <= bound <= POOL
    # flat: the second half of the stream holds no more than the quarter before it (compressions round the kept
    # region down to whole blocks, so what a push leaves varies by a block or two, but never grows with length)
    half = len(held) // 2
    assert max(h.held_blocks for h in held[half:]) <= max(h.held_blocks for h in held[half // 2:half])
    answer = session.push({"prompt": "What color was the square?<|im_end|>\n<|im_start|>assistant\n"})
    assert len(answer) == 1
    session.close()
    assert snapshot(llm).free_blocks == free


def test_a_request_with_more_text_than_max_text_tokens_ends_with_an_error(tiny_model, make_llm):
    from vllm import SamplingParams

    llm = _llm(make_llm, tiny_model, max_model_len=4 * POOL * BLOCK, max_text_tokens=MAX_TEXT)
    long_text = "<|im_start|>user\n" + "describe the scene " * 60 + "<|im_end|>\n<|im_start|>assistant\n"
    short_text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    outs = llm.generate([long_text, short_text], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 2
    assert snapshot(llm).free_blocks == POOL


@pytest.mark.parametrize("policy", ["cords", "none"])
def test_a_session_past_max_model_len_ends_alone_and_the_engine_serves_on(tiny_model, policy, make_llm):
    """vLLM checks a request's length only when it arrives; a session grows with every turn. The turn that takes
    it to --max-model-len ends it with an error (its reason published by its external id) before any step
    schedules it: the engine, and every other session, serve on. Under a policy a stream's length is what it
    holds plus the turn, so it gets there with text it can never evict (the policy's max_text_tokens is set
    above max-model-len here); without one, with every token it pushed."""
    from cords_vllm.integration.engine_core.hooks import scheduler_hooks
    from cords_vllm.integration.inprocess.introspect import scheduler_of
    from cords_vllm.integration.inprocess.session import SessionClosed

    max_len = 1024
    if policy == "cords":
        llm = _llm(make_llm, tiny_model, max_model_len=max_len, pool=2 * POOL, max_text_tokens=max_len)
    else:
        # room for both sessions at full length: without a policy, a pool full of sessions stalls them all
        pool_bytes = (2 * max_len // BLOCK + 1) * kv_bytes_per_block(tiny_model, BLOCK, 4)
        llm = make_llm(tiny_model, block_size=BLOCK, max_model_len=max_len, kv_cache_memory_bytes=pool_bytes)
    free = snapshot(llm).free_blocks
    other = EngineSession(llm, "other")
    other.push({"prompt": "<|im_start|>user\n" + CLIP, "multi_modal_data": {"video": video(4, seed=1)}})
    other_tokens = snapshot(llm).requests[other.request_id].candidate_tokens
    session = EngineSession(llm, "camera")
    text = "<|im_start|>user\n" + "describe the scene " * 20  # text a policy never evicts
    per_push = 130 if policy == "none" else len(llm.get_tokenizer().encode(text))
    with pytest.raises(SessionClosed, match="ended session camera"):
        for i in range(max_len // per_push + 2):
            if policy == "none":
                session.push({"prompt": ("<|im_start|>user\n" if i == 0 else "") + CLIP,
                              "multi_modal_data": {"video": video(4, seed=i % 7)}})
            else:
                session.push({"prompt": text})
    assert i == -(-max_len // per_push) - 1  # the first push that reaches it, not an earlier one
    publisher = scheduler_hooks(scheduler_of(llm)).publisher
    assert "--max-model-len is 1024" in publisher.ended["camera"]
    assert session.request_id not in snapshot(llm).requests
    answer = other.push({"prompt": "What color was the square?<|im_end|>\n<|im_start|>assistant\n"}, max_tokens=2)
    assert len(answer) == 2 and snapshot(llm).requests[other.request_id].candidate_tokens == other_tokens
    other.close()
    assert snapshot(llm).free_blocks == free


def test_only_a_session_is_ended_for_its_length_and_only_when_no_token_fits():
    from types import SimpleNamespace

    from cords_vllm.integration.engine_core.ending import length_reason

    assert length_reason(SimpleNamespace(resumable=True, num_tokens=1023), 1024) is None
    assert "--max-model-len is 1024" in length_reason(SimpleNamespace(resumable=True, num_tokens=1024), 1024)
    assert length_reason(SimpleNamespace(resumable=False, num_tokens=5000), 1024) is None  # vLLM checked it


def test_a_streams_host_state_stays_bounded_by_what_it_holds_across_50_pushes(tiny_model, make_llm):
    """Re-based at every turn: the request's token lists, row, inputs and the worker's positions follow what the
    stream holds plus one clip, never what it pushed (50 pushes: 6,500 tokens, past --max-model-len)."""
    from cords_vllm.integration.inprocess.introspect import host_lengths

    llm = _llm(make_llm, tiny_model, max_model_len=1024, max_text_tokens=MAX_TEXT)
    session = EngineSession(llm, "camera")
    lengths = []
    for i in range(50):
        session.push({"prompt": ("<|im_start|>user\n" if i == 0 else "") + CLIP,
                      "multi_modal_data": {"video": video(4, seed=i % 7)}})
        lengths.append(host_lengths(llm, session.request_id))
    bound = stream_footprint_blocks(MAX_TEXT, BudgetSettings(BUDGET, BUDGET // 4, SLACK), BLOCK) * BLOCK + 130
    for n in lengths:
        assert n.worker_tokens == n.worker_positions == n.prompt  # the worker's copy is the scheduler's
        assert max(n.tokens, n.prompt, n.num_computed, n.worker_tokens) <= bound + 1
        assert n.row == n.worker_row <= -(-bound // BLOCK)
        assert n.inputs == n.worker_inputs <= (BUDGET + SLACK) // 128 + 3
    late, early = lengths[25:], lengths[5:25]
    assert max(n.tokens for n in late) <= max(n.tokens for n in early)  # flat, not growing with the pushes
    answer = session.push({"prompt": "What color was the square?<|im_end|>\n<|im_start|>assistant\n"})
    assert len(answer) == 1
    session.close()


def _next_position(llm, req_id):
    from cords_vllm.integration.engine_core.hooks import scheduler_hooks
    from cords_vllm.integration.inprocess.introspect import scheduler_of

    return scheduler_hooks(scheduler_of(llm)).compressor.trackers[req_id].next_position


@pytest.mark.slow  # the same limit over HTTP, in the default suite: tests/streams/test_stream_limits.py
def test_a_stream_passes_its_rotary_range_in_tokens_answers_and_ends_at_its_position_range(short_range_model, make_llm):
    """A 4-frame clip is 130 tokens but 10 positions: a stream passes max_position_embeddings (1024) in tokens
    and keeps answering; the turn whose positions would pass the range ends it alone, with the reason."""
    from cords_vllm.integration.engine_core.hooks import scheduler_hooks
    from cords_vllm.integration.inprocess.introspect import scheduler_of
    from cords_vllm.integration.inprocess.session import SessionClosed
    from tests.conftest import SHORT_RANGE

    llm = _llm(make_llm, short_range_model, max_model_len=512, max_text_tokens=MAX_TEXT)
    free = snapshot(llm).free_blocks
    other = EngineSession(llm, "other")
    other.push({"prompt": "<|im_start|>user\n" + CLIP, "multi_modal_data": {"video": video(4, seed=1)}})
    session = EngineSession(llm, "camera")
    question = {"prompt": "What color was the square?<|im_end|>\n<|im_start|>assistant\n"}
    positions = []
    with pytest.raises(SessionClosed, match="ended session camera"):
        for i in range(200):
            session.push({"prompt": ("<|im_start|>user\n" if i == 0 else "<|im_end|>\n<|im_start|>user\n"
                                     if i == 21 else "") + CLIP, "multi_modal_data": {"video": video(4, seed=i % 7)}})
            positions.append(_next_position(llm, session.request_id))
            if i == 20:  # 2,700 tokens pushed: past the rotary range in tokens, a fraction of it in positions
                assert 130 * (i + 1) > SHORT_RANGE and positions[-1] < SHORT_RANGE // 3
                assert len(session.push(question, max_tokens=4)) == 4
    assert positions[-1] <= SHORT_RANGE < positions[-1] + 10  # the first push that would pass, not earlier
    reason = scheduler_hooks(scheduler_of(llm)).publisher.ended["camera"]
    assert "rotary positions" in reason and "max_position_embeddings" in reason
    assert len(other.push(question, max_tokens=2)) == 2  # the engine, and the other stream, serve on
    other.close()
    assert snapshot(llm).free_blocks == free


def test_streams_filling_the_pool_to_their_footprints_are_never_preempted(tiny_model, make_llm):
    """A re-based stream can no longer be recomputed from its own tokens, so it must never be preempted:
    admission by footprint guarantees it. Four streams whose footprints fill the pool exactly push clips turn
    by turn, all at once; none is ever preempted, and each answers."""
    from cords_vllm.integration.inprocess.introspect import scheduler_of
    from cords_vllm.integration.inprocess.session import run_turns

    settings = BudgetSettings(BUDGET, BUDGET // 4, SLACK)
    footprint = stream_footprint_blocks(MAX_TEXT, settings, BLOCK)
    llm = _llm(make_llm, tiny_model, max_model_len=1024, pool=4 * footprint, max_text_tokens=MAX_TEXT)
    scheduler = scheduler_of(llm)
    sessions = [EngineSession(llm, f"camera-{i}") for i in range(4)]
    for push in range(12):
        run_turns(llm.llm_engine, [(s, {"prompt": ("<|im_start|>user\n" if push == 0 else "") + CLIP,
                                        "multi_modal_data": {"video": video(4, seed=(push + i) % 7)}})
                                   for i, s in enumerate(sessions)])
        assert all(scheduler.requests[s.request_id].num_preemptions == 0 for s in sessions)
    assert all(snapshot(llm).requests[s.request_id].evicted_tokens > 0 for s in sessions)  # re-based
    question = {"prompt": "What color was the square?<|im_end|>\n<|im_start|>assistant\n"}
    answers = run_turns(llm.llm_engine, [(s, question) for s in sessions])
    assert all(len(tokens) == 1 for tokens in answers.values())
    assert all(scheduler.requests[s.request_id].num_preemptions == 0 for s in sessions)
    for session in sessions:
        session.abort()
    llm.llm_engine.step()  # aborted requests reach the workers with the next step
    assert snapshot(llm).free_blocks == 4 * footprint


def test_a_rebased_stream_the_scheduler_must_preempt_ends_alone_with_its_reason(tiny_model, make_llm):
    """Should the pool still run out (it cannot through admission), preempting a re-based stream would recompute
    it from tokens it no longer has: it is ended, with its reason, instead."""
    from cords_vllm.integration.engine_core.hooks import scheduler_hooks
    from cords_vllm.integration.inprocess.introspect import scheduler_of
    from cords_vllm.integration.inprocess.session import SessionClosed

    llm = _llm(make_llm, tiny_model, max_model_len=1024, max_text_tokens=MAX_TEXT)
    free = snapshot(llm).free_blocks
    scheduler = scheduler_of(llm)
    session = EngineSession(llm, "camera")
    for i in range(6):
        session.push({"prompt": ("<|im_start|>user\n" if i == 0 else "") + CLIP,
                      "multi_modal_data": {"video": video(4, seed=i)}})
    assert snapshot(llm).requests[session.request_id].evicted_tokens > 0
    session.start_turn({"prompt": CLIP, "multi_modal_data": {"video": video(4, seed=9)}})
    session.step()
    request = scheduler.requests[session.request_id]
    scheduler.running.remove(request)  # what vLLM's schedule() does to a victim, before _preempt_request
    scheduler._preempt_request(request, 0.0)
    scheduler.waiting.prepend_request(request)
    with pytest.raises(SessionClosed):
        session.finish_turn()
    assert "cannot be recomputed" in scheduler_hooks(scheduler).publisher.ended["camera"]
    llm.llm_engine.step()
    assert snapshot(llm).free_blocks == free
