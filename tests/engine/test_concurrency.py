"""Compression admits more streams: a pool for two uncompressed videos runs eight at once with cords."""

from __future__ import annotations

import pytest

from cords_vllm.compress.plan import BudgetSettings, compressed_footprint_blocks
from cords_vllm.utils import cdiv
from tests.engine.conftest import BLOCK, VIDEO_PROMPT, EngineRun, run_engine, video

pytestmark = pytest.mark.engine

FRAMES = 64  # 2048 video tokens, 2063-token prompt


def _pool_kwargs(tiny_model) -> dict:
    import json
    import pathlib

    text = json.loads((pathlib.Path(tiny_model) / "config.json").read_text())["text_config"]
    head = text["hidden_size"] // text["num_attention_heads"]
    bytes_per_block = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head * BLOCK * 4  # fp32
    blocks_per_video = cdiv(2063 + 4, BLOCK)
    # The encoder cache (sized by max_num_batched_tokens) holds 8 videos and each step may advance 8
    # requests by one 256-token chunk each, so only KV blocks limit how many run at once.
    return {"kv_cache_memory_bytes": (2 * blocks_per_video + 1) * bytes_per_block, "max_model_len": 4096,
            "max_num_batched_tokens": 8 * 2048, "max_num_scheduled_tokens": 8 * 256,
            "long_prefill_token_threshold": 256,
            # off in both engines: under none a preempted request would find its blocks again, which the
            # policy's requests over budget never do; the engines then differ only in the policy
            "enable_prefix_caching": False}


def _prompts() -> list[dict]:
    return [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(FRAMES, seed=i)}} for i in range(8)]


@pytest.fixture(scope="module")
def none_run(tiny_model) -> EngineRun:
    """The eight videos in the pool for two, uncompressed (both tests compare with it)."""
    return run_engine(tiny_model, _prompts(), "none", max_tokens=4, engine_kwargs=_pool_kwargs(tiny_model))


def test_eight_videos_run_concurrently_under_cords_but_not_none(tiny_model, none_run):
    kwargs = _pool_kwargs(tiny_model)
    cords = run_engine(tiny_model, _prompts(), "cords", max_tokens=4, engine_kwargs=kwargs, budget=256, slack=64)
    assert all(len(t) == 4 for t in cords.token_ids)
    assert cords.max_running >= 6, cords.max_running
    assert cords.num_preemptions == 0
    assert cords.free_blocks_after == cords.free_blocks_before
    # the server's high-water mark is the most any request held (recorded here after every step)
    assert cords.published_peak == max(cords.max_blocks_held.values())
    assert cords.published_peak <= compressed_footprint_blocks(2063 + 4, FRAMES * 32, BudgetSettings(256, 64, 64),
                                                               BLOCK)
    none = none_run
    assert all(len(t) == 4 for t in none.token_ids)
    # uncompressed, at most two fit: the others wait, or are admitted and then preempted
    assert none.max_running <= 2 or none.num_preemptions > 0, (none.max_running, none.num_preemptions)
    assert none.free_blocks_after == none.free_blocks_before
    assert none.published_peak == max(none.max_blocks_held.values())
    assert cdiv(2063, BLOCK) <= none.published_peak <= cdiv(2063 + 4, BLOCK)  # the whole prompt and its answer


def test_requests_the_policy_never_compresses_are_admitted_as_under_none(tiny_model, none_run):
    """A budget the videos never pass (as after vLLM's video pruning): the policy bounds nothing, so admission,
    preemption and every token are vLLM's own; the growth reserve is kept for requests the policy bounds."""
    none = none_run
    assert none.num_preemptions > 0  # the pool binds: vLLM admits, then preempts
    cords = run_engine(tiny_model, _prompts(), "cords", max_tokens=4, engine_kwargs=_pool_kwargs(tiny_model),
                       budget=FRAMES * 32, slack=64, max_text_tokens=64)
    assert cords.compressions == 0
    assert (cords.max_running, cords.num_preemptions) == (none.max_running, none.num_preemptions)
    assert cords.token_ids == none.token_ids
    assert cords.free_blocks_after == cords.free_blocks_before
