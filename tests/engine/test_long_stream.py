"""A stream far longer than the KV pool: the start-up rule asks for its bounded footprint, blocks stay flat."""

from __future__ import annotations

import gc

import pytest

from cords_vllm.compress.plan import BudgetSettings, stream_footprint_blocks
from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess.introspect import snapshot
from cords_vllm.integration.inprocess.llm import make_llm
from cords_vllm.integration.inprocess.session import EngineSession
from cords_vllm.lab.bench.offline import kv_bytes_per_block
from tests.engine.conftest import BLOCK, video

pytestmark = pytest.mark.engine

POOL = 24  # blocks of 32 tokens: 768 tokens
BUDGET, SLACK, MAX_TEXT = 192, 64, 128
CLIP = "<|vision_start|><|video_pad|><|vision_end|>"


def _llm(model, max_model_len: int, **config):
    pool_bytes = (POOL + 1) * kv_bytes_per_block(model, BLOCK, 4)  # + the null block
    return make_llm(model, block_size=BLOCK, max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
                    max_num_scheduled_tokens=512, kv_cache_memory_bytes=pool_bytes,
                    **kv_policy_args("cords", budget=BUDGET, slack=SLACK, **config))


def test_without_max_text_tokens_vllm_still_asks_for_one_max_model_len_request(tiny_model):
    with pytest.raises(ValueError, match="max seq len"):
        _llm(tiny_model, max_model_len=4 * POOL * BLOCK)


def test_by_default_the_pool_must_hold_the_footprint_of_8192_text_tokens_not_max_model_len(tiny_model):
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
    gc.collect()
    with pytest.raises(ValueError, match="max seq len"):  # without a policy, vLLM's own rule
        make_llm(tiny_model, **engine)


def test_a_stream_runs_to_twenty_pools_with_flat_blocks(tiny_model):
    pushes = 20 * POOL * BLOCK // 128 + 1  # 128 video tokens a push
    llm = _llm(tiny_model, max_model_len=(pushes + 8) * 128, max_text_tokens=MAX_TEXT)
    free = snapshot(llm).free_blocks
    assert free == POOL  # the pool really is smaller than the stream by 20x
    bound = stream_footprint_blocks(MAX_TEXT, BudgetSettings(BUDGET, BUDGET // 4, SLACK), BLOCK)
    session = EngineSession(llm, "camera")
    held = []
    for i in range(pushes):
        session.push({"prompt": ("<|im_start|>user\n" if i == 0 else "") + CLIP,
                      "multi_modal_data": {"video": video(4, seed=i % 7)}})
        held.append(snapshot(llm).requests[session.request_id])
    assert held[-1].candidate_tokens >= 20 * POOL * BLOCK
    assert max(h.held_blocks for h in held) <= bound <= POOL
    assert held[-1].held_blocks == held[len(held) // 2].held_blocks  # flat: the same at half and full length
    answer = session.push({"prompt": "What color was the square?<|im_end|>\n<|im_start|>assistant\n"})
    assert len(answer) == 1
    session.close()
    assert snapshot(llm).free_blocks == free
    del llm
    gc.collect()


def test_a_request_with_more_text_than_max_text_tokens_ends_with_an_error(tiny_model):
    from vllm import SamplingParams

    llm = _llm(tiny_model, max_model_len=4 * POOL * BLOCK, max_text_tokens=MAX_TEXT)
    long_text = "<|im_start|>user\n" + "describe the scene " * 60 + "<|im_end|>\n<|im_start|>assistant\n"
    short_text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    outs = llm.generate([long_text, short_text], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 2
    assert snapshot(llm).free_blocks == POOL
    del llm
    gc.collect()


@pytest.mark.parametrize("policy", ["cords", "none"])
def test_a_session_past_max_model_len_ends_alone_and_the_engine_serves_on(tiny_model, policy):
    """vLLM checks a request's length only when it arrives; a session grows with every turn. The turn that takes
    it to --max-model-len ends it with an error (its reason published by its external id) before any step
    schedules it: the engine, and every other session, serve on."""
    from cords_vllm.integration.engine_core.hooks import scheduler_hooks
    from cords_vllm.integration.inprocess.introspect import scheduler_of
    from cords_vllm.integration.inprocess.session import SessionClosed

    max_len = 1024
    if policy == "cords":
        llm = _llm(tiny_model, max_model_len=max_len, max_text_tokens=MAX_TEXT)
    else:
        # room for both sessions at full length: without a policy, a pool full of sessions stalls them all
        pool_bytes = (2 * max_len // BLOCK + 1) * kv_bytes_per_block(tiny_model, BLOCK, 4)
        llm = make_llm(tiny_model, block_size=BLOCK, max_model_len=max_len, kv_cache_memory_bytes=pool_bytes)
    free = snapshot(llm).free_blocks
    other = EngineSession(llm, "other")
    other.push({"prompt": "<|im_start|>user\n" + CLIP, "multi_modal_data": {"video": video(4, seed=1)}})
    other_tokens = snapshot(llm).requests[other.request_id].candidate_tokens
    session = EngineSession(llm, "camera")
    with pytest.raises(SessionClosed, match="ended session camera"):
        for i in range(max_len // 128 + 2):  # 130 tokens a push
            session.push({"prompt": ("<|im_start|>user\n" if i == 0 else "") + CLIP,
                          "multi_modal_data": {"video": video(4, seed=i % 7)}})
    assert i == max_len // 130  # the first push past the limit, not an earlier one
    publisher = scheduler_hooks(scheduler_of(llm)).publisher
    assert "--max-model-len is 1024" in publisher.ended["camera"]
    assert session.request_id not in snapshot(llm).requests
    answer = other.push({"prompt": "What color was the square?<|im_end|>\n<|im_start|>assistant\n"}, max_tokens=2)
    assert len(answer) == 2 and snapshot(llm).requests[other.request_id].candidate_tokens == other_tokens
    other.close()
    assert snapshot(llm).free_blocks == free
    del llm
    gc.collect()


def test_only_a_session_is_ended_for_its_length_and_only_when_no_token_fits():
    from types import SimpleNamespace

    from cords_vllm.integration.engine_core.ending import length_reason

    assert length_reason(SimpleNamespace(resumable=True, num_tokens=1023), 1024) is None
    assert "--max-model-len is 1024" in length_reason(SimpleNamespace(resumable=True, num_tokens=1024), 1024)
    assert length_reason(SimpleNamespace(resumable=False, num_tokens=5000), 1024) is None  # vLLM checked it
