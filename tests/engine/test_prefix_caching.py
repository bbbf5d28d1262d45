"""Prefix caching under a policy (vLLM's default, on): the requests the policy never compresses use vLLM's cache as
under ``none``; the ones it may compress neither read nor fill it, and keep the tokens they keep with the cache
off."""

from __future__ import annotations

import pytest

from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.integration.inprocess.introspect import scheduler_of, snapshot
from tests.engine.conftest import BLOCK, CHUNK, TEXT_PROMPT, VIDEO_PROMPT, video

pytestmark = pytest.mark.engine

FRAMES = 16  # 512 video tokens
#: A system prompt of a few blocks, shared by a text request and a video request.
SYSTEM = "<|im_start|>system\n" + "You answer questions about videos, briefly and carefully. " * 12 + "<|im_end|>\n"


@pytest.fixture
def cache_hits(monkeypatch) -> list[tuple[str, int]]:
    """``(request id, tokens found)`` of every prefix-cache lookup that found tokens."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    hits: list[tuple[str, int]] = []
    original = KVCacheManager.get_computed_blocks

    def get_computed_blocks(self, request):
        found = original(self, request)
        if found[1] > 0:
            hits.append((request.request_id, found[1]))
        return found

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", get_computed_blocks)
    return hits


def _generate(llm, prompts: list[dict]) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(make_llm, model: str, caching: bool, budget: int):
    return make_llm(model, block_size=BLOCK, max_num_batched_tokens=4096, max_num_scheduled_tokens=CHUNK,
                    enable_prefix_caching=caching, **kv_policy_args("cords", budget=budget, slack=64))


def test_requests_the_policy_never_compresses_use_the_cache(tiny_model, cache_hits, make_llm):
    """Text, and a video within budget + slack: the second identical request finds the first one's blocks."""
    llm = _llm(make_llm, tiny_model, caching=True, budget=FRAMES * 32)
    scheduler = scheduler_of(llm)
    assert scheduler.kv_cache_manager.enable_caching
    text = {"prompt": TEXT_PROMPT * 8}
    clip = {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(FRAMES, seed=1)}}
    first = _generate(llm, [text, clip])
    assert cache_hits == []
    second = _generate(llm, [text])
    third = _generate(llm, [clip])
    assert second == first[:1] and third == first[1:]
    assert len({r for r, _ in cache_hits}) == 2 and all(n >= BLOCK for _, n in cache_hits)
    assert snapshot(llm).compressions == 0


def test_requests_the_policy_compresses_bypass_the_cache_and_keep_their_tokens(tiny_model, cache_hits, make_llm):
    """A video over budget + slack: compressed as with the cache off, never found in it, never filling it, and
    never reading it, not even the blocks of a cached text request with the same system prompt."""
    clip = {"prompt": SYSTEM + VIDEO_PROMPT, "multi_modal_data": {"video": video(FRAMES, seed=2)}}
    text = {"prompt": SYSTEM + TEXT_PROMPT}
    runs, compressions = {}, {}
    for caching in (False, True):
        llm = _llm(make_llm, tiny_model, caching=caching, budget=128)
        _generate(llm, [text])  # fills the cache with the system prompt's blocks (when on)
        runs[caching] = (_generate(llm, [clip]), _generate(llm, [clip]))
        state = snapshot(llm)
        compressions[caching] = state.compressions
        assert state.free_blocks == state.total_blocks  # every block back
        if caching:
            pool = scheduler_of(llm).kv_cache_manager.block_pool
            # the text request's blocks only: nothing of the compressed request was cached
            text_blocks = (len(llm.get_tokenizer()(text["prompt"]).input_ids) + 4) // BLOCK
            assert 0 < len(pool.cached_block_hash_to_block) <= text_blocks
        del llm
        settle()
    assert compressions[True] == compressions[False] > 0
    assert runs[True] == runs[False]
    assert runs[True][0] == runs[True][1]
    assert cache_hits == []  # the second identical request did not look it up


def test_the_policy_leaves_prefix_caching_as_configured(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    from cords_vllm.config import KVPolicyConfig
    from cords_vllm.integration.startup.engine_args import adjust_engine_args

    policy = KVPolicyConfig.parse("cords", None)
    for asked in (None, True, False):
        args = EngineArgs(model=tiny_model, enable_prefix_caching=asked)
        adjust_engine_args(args, policy)
        assert args.enable_prefix_caching is asked
