"""Every policy of the registry runs through the same engine path, exactly (the shared test matrix)."""

from __future__ import annotations

import pytest

from cords_vllm.selection import available_selectors
from tests.engine.conftest import VIDEO_PROMPT, chunks_for, evictions_of, run_engine, video

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("policy", available_selectors())
def test_policy_compresses_exactly_and_returns_blocks(tiny_model, hf_reference, policy):
    frames = video(32, seed=11)
    run = run_engine(tiny_model, [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}], policy,
                     max_tokens=4, budget=192, slack=64)
    assert len(run.events) >= 2
    assert run.free_blocks_after == run.free_blocks_before
    evictions = evictions_of(run.events)
    chunks = chunks_for(run.prompt_lens[0], evictions)
    ref = hf_reference.run(VIDEO_PROMPT, frames, max_new_tokens=4, chunk_sizes=chunks,
                           evictions=evictions, forced_tokens=run.token_ids[0])
    assert run.token_ids[0] == ref.token_ids
    ref_lp = ref.logits.log_softmax(-1)
    worst = max(abs(v - float(ref_lp[s, t])) for s, top in enumerate(run.logprobs[0]) for t, v in top.items())
    assert worst < 2e-4
