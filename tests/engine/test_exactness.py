"""Compression keeps the model's math: the engine equals an HF reference that drops the same tokens.

The reference (HF transformers, fp32) prefills with the engine's chunk boundaries, evicts from each layer's
(and head's) cache exactly the logical tokens the engine's workers evicted, at the same chunk starts, keeps
original M-RoPE positions (vLLM's rule), and is teacher-forced with the engine's tokens.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import TEXT_PROMPT, VIDEO_PROMPT, chunks_for, evictions_of, run_engine, video

pytestmark = pytest.mark.engine

TOL = 2e-4  # fp32 log-prob agreement; the uncompressed HF-vs-vLLM floor is ~1e-6


def _compare(run, ref_result, index=0):
    assert run.token_ids[index] == ref_result.token_ids, "greedy tokens differ"
    ref_lp = ref_result.logits.log_softmax(-1)
    worst = 0.0
    for step, top in enumerate(run.logprobs[index]):
        for token, lp in top.items():
            worst = max(worst, abs(lp - float(ref_lp[step, token])))
    return worst


@pytest.mark.parametrize("config", [
    # the default unit, auto: here runs of 4 tokens, the fixed-run path `block` granularity takes
    pytest.param({}, id="cords-default-auto-runs"),
    pytest.param({"granularity": "frame"}, id="cords-one-anchor-frame"),
    pytest.param({"anchors": [0, 2]}, id="cords-two-anchors"),
    pytest.param({"per_head": True, "anchors": "all"}, id="cords-per-head-all-layers"),
    pytest.param({"granularity": "token"}, id="cords-token"),
])
def test_compressed_engine_equals_reference(tiny_model, hf_reference, config):
    frames = video(48)
    prompt = {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}
    run = run_engine(tiny_model, [prompt], "cords", max_tokens=6, budget=256, slack=64, **config)
    assert len(run.events) >= 2, "the prompt must be compressed at least twice"
    evictions = evictions_of(run.events)
    chunks = chunks_for(run.prompt_lens[0], evictions)
    ref = hf_reference.run(VIDEO_PROMPT, frames, max_new_tokens=6, chunk_sizes=chunks,
                           evictions=evictions, forced_tokens=run.token_ids[0])
    assert _compare(run, ref) < TOL
    # negative control: the same reference without the engine's evictions disagrees clearly
    uncompressed = hf_reference.run(VIDEO_PROMPT, frames, max_new_tokens=6, forced_tokens=run.token_ids[0])
    ref_lp, lp = uncompressed.logits.log_softmax(-1), run.logprobs[0]
    gap = max(abs(v - float(ref_lp[s, t])) for s, top in enumerate(lp) for t, v in top.items())
    assert gap > 50 * TOL


def test_none_and_large_budget_equal_the_plain_engine(tiny_model):
    prompts = [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(32)}}, {"prompt": TEXT_PROMPT}]
    plain = run_engine(tiny_model, prompts, "none", max_tokens=8)
    large = run_engine(tiny_model, prompts, "cords", max_tokens=8, budget=4096)
    assert large.events == []
    assert large.token_ids == plain.token_ids
    for a, b in zip(large.logprobs, plain.logprobs, strict=True):
        for sa, sb in zip(a, b, strict=True):
            assert sa.keys() == sb.keys()
            assert max(abs(sa[t] - sb[t]) for t in sa) < 1e-5
